"""Run under torchrun by tests/learner/test_integrity_check.py: the policy check on 2 ranks (gloo, CPU).

Every rank builds the tiny policy, trains one step and publishes v1 (only rank 0 knows its sha256), then checks
one batch: two honest groups (v1 and v0, log-probs from a reference model in rank 0: the base, or the base + the
published v1 through peft), one with
made-up log-probs and one whose evidence names another sha256 (which only rank 0 can judge), plus an honest and a
made-up group of rows longer than the token budget (re-scored in segments). Every rank must keep exactly the
honest groups; rank 0 prints what was kept and dropped. Then ten steps under probation and audits
(:func:`trusted_steps`): every rank must re-score the same rows and hold the same trust.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from loraflow.common.config import load_config
from loraflow.learner import data, publish, rescoring
from loraflow.learner.integrity import IntegrityCheck
from loraflow.learner.loss import LossConfig
from loraflow.learner.model import build_policy
from loraflow.learner.parallel import init_parallel
from loraflow.learner.step import make_optimizer, train_step
from tests.learner.scripted import (
    VOCAB,
    Sampled,
    Scorer,
    encode_groups,
    make_batch,
    rollout_group,
    served_for,
)


def group(scorers: dict[int, Scorer], rng: np.random.Generator, group_id: str, version: int, sha256: str,
          made_up: bool = False, completion_len: int = 10, worker_id: str | None = None) -> tuple:
    samples = []
    for _ in range(4):
        prompt = rng.integers(3, VOCAB, 6).astype(np.int32)
        completion = rng.integers(3, VOCAB, completion_len + int(rng.integers(0, 10))).astype(np.int32)
        logp = scorers[version].logprobs(prompt, completion, 1.0)
        if made_up:
            logp = np.full_like(logp, -0.5)
        n = len(completion)
        samples.append(Sampled(prompt, completion, logp.astype(np.float32), np.full(n, version, dtype=np.int32),
                               np.ones(n, dtype=np.uint8)))
    return rollout_group(group_id, samples, [served_for(version, sha256)], worker_id=worker_id or group_id)


def main(model_dir: Path) -> None:
    parallel = init_parallel("cpu")
    config = load_config(None, ["learner.lora_rank=8", "learner.lr=0.05", "learner.warmup_steps=0",
                                "learner.micro_batch_tokens=64", "integrity.samples_per_group=3"])
    policy = build_policy(model_dir, config.learner, parallel, seed=0)
    optimizer, scheduler = make_optimizer(policy, config.learner)
    check = IntegrityCheck(config, policy, parallel)
    check.record(0, "")
    # the history's gather of FSDP2 shards, uneven ones too (rows not a multiple of the ranks, a rank with none)
    full = [torch.arange(15.0).view(5, 3), torch.arange(4.0).view(1, 4), torch.arange(6.0).view(6, 1)]
    whole = rescoring._whole([distribute_tensor(t, parallel.mesh, [Shard(0)]) for t in full])
    assert all(torch.equal(a, b) for a, b in zip(whole, full, strict=True)), whole
    train_step(policy, optimizer, scheduler, data.decode_step_batch(make_batch(3, 0, num_groups=2, group_size=4)),
               parallel=parallel, config=config, loss_config=LossConfig.from_learner(config.learner))
    snap = publish.snapshot(policy, version=1, step=1, is_main=parallel.is_main)
    check.record(1, snap.sha256 if snap is not None else None)
    frames = None
    if parallel.is_main:  # rank 0 builds the batch and sends the frames, as the learner loop does
        rng = np.random.default_rng(0)
        scorers = {0: Scorer(model_dir), 1: Scorer(model_dir, snap.tensors, policy.lora_config)}
        groups = [group(scorers, rng, "good-0", 1, snap.sha256), group(scorers, rng, "good-1", 0, ""),
                  group(scorers, rng, "made-up", 1, snap.sha256, made_up=True),
                  group(scorers, rng, "bad-sha", 1, "0" * 64),  # only rank 0 knows the published hash
                  # rows of 95-105 positions against the 64-token budget: re-scored in 2 segments each, on
                  # whichever rank they land (the ranks' numbers of forwards differ and are padded)
                  group(scorers, rng, "good-long", 1, snap.sha256, completion_len=90),
                  group(scorers, rng, "made-up-long", 1, snap.sha256, made_up=True, completion_len=90)]
        frames = encode_groups(groups)
    step = data.decode_step_batch(parallel.broadcast_frames(frames))
    verdict = check.run(step)
    kept = [step.group_ids[g] for g in verdict.keep]
    everyone: list = [None] * parallel.world_size
    dist.all_gather_object(everyone, kept)
    assert all(k == kept for k in everyone), everyone
    if parallel.is_main:
        dropped = [(m.group_id, m.reason) for m in verdict.mismatches]
        print(f"integrity ok on {parallel.world_size} ranks: kept {kept}, dropped {dropped}", flush=True)
    trusted_steps(parallel, check, model_dir, snap)
    dist.barrier()


def trusted_steps(parallel, check: IntegrityCheck, model_dir: Path, snap) -> None:  # noqa: ANN001
    """Probation and audits on 2 ranks: steps of one worker's honest groups, trusted after 2 passes, audited on
    half the steps by the shared secret draw, a made-up group from it at step 6 (an audited one: caught, and the
    worker back on probation). Every rank must re-score the same
    rows (each forward is a collective: a disagreement would hang) and hold the same trust."""
    check.trust.probation_groups, check.trust.audit_fraction = 2, 0.5
    scorers = ({0: Scorer(model_dir), 1: Scorer(model_dir, snap.tensors, check.policy.lora_config)}
               if parallel.is_main else {})
    rng = np.random.default_rng(1)
    seen = []
    for index in range(10):
        frames = None
        if parallel.is_main:
            groups = [group(scorers, rng, f"{index}:a", 1, snap.sha256, worker_id="steady"),
                      group(scorers, rng, f"{index}:b", 0, "", worker_id="steady")]
            if index == 6:
                groups.append(group(scorers, rng, f"{index}:lie", 1, snap.sha256, made_up=True, worker_id="steady"))
            frames = encode_groups(groups, batch_id=f"trust-{index}")
        step = data.decode_step_batch(parallel.broadcast_frames(frames))
        check.trust.audit_fraction = 1.0 if index == 6 else 0.5  # the lie's step is drawn for an audit
        verdict = check.run(step)
        check.settle(step, verdict)
        seen.append((verdict.audited, verdict.num_forwards > 0, [m.group_id for m in verdict.mismatches],
                     check.trust.on_probation("steady#")))
    everyone: list = [None] * parallel.world_size
    dist.all_gather_object(everyone, seen)
    assert all(s == seen for s in everyone), everyone
    assert not seen[1][3] and seen[6][2] == ["6:lie"] and seen[6][3], seen  # trusted by step 1; caught, on probation
    if parallel.is_main:
        print(f"trust ok on {parallel.world_size} ranks: {sum(a for a, *_ in seen)} of {len(seen)} steps "
              f"re-scored every group, caught {[m for _, _, m, _ in seen if m]}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # as gather_ranks.py: leave without tearing gloo down
