"""The learner's policy check (learner/integrity.py) on the tiny model, with groups sampled and scored by a
reference Hugging Face model (tests/learner/scripted.py's Scorer: the base, or the base + a published adapter
through peft, float32), checked by a real sharded policy that trained two versions.

Correct groups pass (no false positive over many groups, several versions); log-probs of the base claiming v1,
of v2 claiming v1, at another temperature, made up, or correct plus noise fail with ``logprobs``; one noisy
token passes; a wrong sha256, missing evidence and a reused lora_id fail on the evidence. The adapter history
scores each version with its own tensors in one forward and never writes the parameters. 2 ranks (torchrun, gloo): every rank drops
the same groups, also one whose sha256 only rank 0 can judge (tests/learner/integrity_ranks.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from loraflow.common.config import load_config
from loraflow.learner import data, publish
from loraflow.learner.evidence import LoraIds
from loraflow.learner.integrity import IntegrityCheck, TrainedCheck
from loraflow.learner.loss import LossConfig
from loraflow.learner.model import build_policy
from loraflow.learner.parallel import init_parallel
from loraflow.learner.step import make_optimizer, train_step
from tests.learner.scripted import (
    Sampled,
    Scorer,
    encode_groups,
    make_batch,
    rollout_group,
    sample_group,
    served_for,
)
from tests.support import run_ranks

OVERRIDES = ["learner.lora_rank=8", "learner.lr=0.05", "learner.warmup_steps=0", "learner.grad_clip=0",
             "learner.micro_batch_tokens=128", "integrity.samples_per_group=2", "run.max_staleness=4"]


@dataclasses.dataclass
class World:
    policy: object
    check: IntegrityCheck
    sha: dict[int, str]
    scorers: dict[int, Scorer]
    snapshots: dict[int, publish.AdapterSnapshot]
    logits: dict[int, torch.Tensor]  # of a fixed input, recorded while the version was current
    parallel: object = None


PROBE = torch.arange(3, 40, dtype=torch.int64)[None]


@pytest.fixture(scope="module")
def world(tiny_model_dir: Path) -> World:
    parallel = init_parallel("cpu")
    config = load_config(None, OVERRIDES)
    policy = build_policy(tiny_model_dir, config.learner, parallel, seed=0)
    optimizer, scheduler = make_optimizer(policy, config.learner)
    check = IntegrityCheck(config, policy, parallel)
    check.record(0, "")
    with torch.no_grad():
        logits = {0: policy.logits(PROBE).clone()}
    sha, scorers, snapshots = {0: ""}, {0: Scorer(tiny_model_dir)}, {}
    for version in (1, 2):  # two trained versions, each far enough from the last for the check to tell them apart
        batch = data.decode_step_batch(make_batch(3, version, num_groups=2, group_size=4))
        train_step(policy, optimizer, scheduler, batch, parallel=parallel, config=config,
                   loss_config=LossConfig.from_learner(config.learner))
        snap = publish.snapshot(policy, version=version, step=version, is_main=True)
        check.record(version, snap.sha256)
        sha[version] = snap.sha256
        snapshots[version] = snap
        scorers[version] = Scorer(tiny_model_dir, snap.tensors, policy.lora_config)
        with torch.no_grad():
            logits[version] = policy.logits(PROBE).clone()
    yield World(policy, check, sha, scorers, snapshots, logits, parallel)
    parallel.close()


def run(world: World, groups: list) -> list[tuple[str, str]]:
    """(group id, reason) of each failed group."""
    verdict = world.check.run(data.decode_step_batch(encode_groups(groups)))
    assert verdict.num_checked_tokens > 0 or not groups
    return [(m.group_id, m.reason) for m in verdict.mismatches]


def honest(world: World, rng: np.random.Generator, group_id: str, version: int, *, worker_id: str = "w",
           temperature: float = 1.0) -> tuple:
    samples = sample_group(world.scorers[version], rng, group_size=4, version=version, temperature=temperature)
    return rollout_group(group_id, samples, [served_for(version, world.sha[version])], worker_id=worker_id)


def test_the_history_scores_each_version_as_it_was_and_never_writes_the_parameters(world: World) -> None:
    """Under AdapterHistory.scoring, each held version's log-probs of a probe equal those of the logits recorded
    while the parameters held it, alone and with all three versions' rows in one forward (a block each)."""
    current = [p.to_local().detach().clone() for p in world.policy.trainable_parameters()]
    inputs, targets = PROBE[:, :-1], PROBE[0, 1:]
    select = torch.ones_like(inputs, dtype=torch.bool)
    expected = {v: torch.log_softmax(world.logits[v][0, :-1].float(), -1).gather(-1, targets[:, None])[:, 0]
                for v in (0, 1, 2)}
    with world.check.history.scoring() as use:
        for version in (0, 1, 2):
            use([(0, 1, version)])
            logp, _ = world.policy.trained_logprobs(inputs, select, targets, 1.0, with_entropy=False)
            assert (logp - expected[version]).abs().max() < 1e-5
        use([(0, 1, 2), (1, 3, 0), (3, 4, 1)])
        logp, _ = world.policy.trained_logprobs(inputs.repeat(4, 1), select.repeat(4, 1), targets.repeat(4), 1.0,
                                                with_entropy=False)
        for row, version in enumerate((2, 0, 0, 1)):
            assert (logp.view(4, -1)[row] - expected[version]).abs().max() < 1e-5
    assert all(torch.equal(p.to_local(), c) for p, c in zip(world.policy.trainable_parameters(), current, strict=True))
    with torch.no_grad():  # the LoRA modules compute with their parameters again
        assert torch.equal(world.policy.logits(PROBE), world.logits[2])
    assert (expected[1] - expected[0]).abs().max() > 0.5 and (expected[2] - expected[1]).abs().max() > 0.5


def test_correct_groups_pass(world: World) -> None:
    rng = np.random.default_rng(1)
    groups = [honest(world, rng, f"ok-{k}", k % 3, worker_id=f"ok-{k % 2}") for k in range(24)]
    assert run(world, groups) == []


def test_groups_the_hf_backend_generates_pass(world: World, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The worker's own engine (left-padded batches through generate, adapters in peft slots) and its evidence."""
    from loraflow.common import codec
    from loraflow.rollout_worker.adapters import AdapterStore
    from loraflow.rollout_worker.backends.base import GenRequest, Sampling
    from loraflow.rollout_worker.backends.hf import HfBackend

    backend = HfBackend(tiny_model_dir, sampling=Sampling(temperature=1.0), device="cpu", seed=0)
    store = AdapterStore(tmp_path / "adapters")
    for snap in world.snapshots.values():  # as a worker receives each AdapterUpdate
        update, envelope = codec.decode(codec.encode(snap.update(), snap.tensors))
        backend.add_adapter(store.receive(update, envelope.specs, envelope.frames))
    rng = np.random.default_rng(8)
    groups = []
    for k in range(12):
        version = k % 3
        prompts = [rng.integers(3, 256, int(rng.integers(3, 10))).astype(np.int32) for _ in range(4)]
        outputs = backend.generate([GenRequest(token_ids=p.tolist(), max_tokens=12, version=version, key=f"{k}:{j}")
                                    for j, p in enumerate(prompts)])
        samples = [Sampled(p, np.array(o.token_ids, dtype=np.int32), np.array(o.logprobs, dtype=np.float32),
                           np.full(len(o.token_ids), version, dtype=np.int32), np.ones(len(o.token_ids), np.uint8))
                   for p, o in zip(prompts, outputs, strict=True)]
        groups.append(rollout_group(f"hf-{k}", samples, [backend.served(version)], worker_id="hf-worker"))
    assert run(world, groups) == []


def wrong(world: World, rng: np.random.Generator, group_id: str, *, claimed: int, scored_by: int,
          temperature: float = 1.0, change=None) -> tuple:
    """Tokens sampled and scored by ``scored_by`` at ``temperature`` (log-probs then changed), claiming ``claimed``."""
    samples = sample_group(world.scorers[scored_by], rng, group_size=4, version=claimed, temperature=temperature)
    for s in samples:
        if change is not None:
            s.logprobs = change(rng, s.logprobs).astype(np.float32)
    return rollout_group(group_id, samples, [served_for(claimed, world.sha[claimed])], worker_id=f"bad-{group_id}")


def test_groups_from_another_policy_or_made_up_fail_with_logprobs(world: World) -> None:
    rng = np.random.default_rng(2)
    groups = [
        wrong(world, rng, "base-as-v1", claimed=1, scored_by=0),
        wrong(world, rng, "v2-as-v1", claimed=1, scored_by=2),
        wrong(world, rng, "v1-as-v2", claimed=2, scored_by=1),
        wrong(world, rng, "temperature", claimed=1, scored_by=1, temperature=0.7),
        wrong(world, rng, "constant", claimed=1, scored_by=1, change=lambda r, lp: np.full_like(lp, -0.5)),
        wrong(world, rng, "noise", claimed=2, scored_by=2, change=lambda r, lp: np.minimum(
            lp + r.normal(0, 0.05, lp.shape), 0)),
    ]
    assert run(world, groups) == [(g.group_id, "logprobs") for g, _ in groups]


def test_one_noisy_token_passes(world: World) -> None:
    def one_off(rng: np.random.Generator, lp: np.ndarray) -> np.ndarray:
        out = lp.copy()
        out[3] -= 1.0
        return out

    assert run(world, [wrong(world, np.random.default_rng(3), "one-token", claimed=1, scored_by=1,
                             change=one_off)]) == []


def test_rows_longer_than_the_budget_are_rescored_in_segments(world: World) -> None:
    """Rows of 245 positions against the 128-token budget: each re-scored in 2 segments (the second reads the
    first's keys and values), giving the unsplit forward's log-probs; honest long groups pass, made-up ones fail."""
    rng = np.random.default_rng(5)
    long = {"prompt_len": 40, "completion_len": 206}

    def long_group(group_id: str, claimed: int, scored_by: int, made_up: bool = False) -> tuple:
        samples = sample_group(world.scorers[scored_by], rng, group_size=4, version=claimed, **long)
        if made_up:
            for s in samples:
                s.logprobs = np.full_like(s.logprobs, -0.5)
        return rollout_group(group_id, samples, [served_for(claimed, world.sha[claimed])], worker_id=group_id)

    groups = [long_group("long-v1", 1, 1), long_group("long-v0", 0, 0), long_group("long-base-as-v1", 1, 0),
              long_group("long-made-up", 1, 1, made_up=True)]
    step = data.decode_step_batch(encode_groups(groups))
    forwards = world.check.rescorer.num_forwards
    verdict = world.check.run(step)
    assert [(m.group_id, m.reason) for m in verdict.mismatches] == [("long-base-as-v1", "logprobs"),
                                                                    ("long-made-up", "logprobs")]
    rows = 2 * len(groups)  # integrity.samples_per_group = 2
    assert world.check.rescorer.num_forwards - forwards == 2 * rows  # one forward per segment, a row per micro-batch
    sample = step.samples[0]
    pairs = [(0, 1)]
    split = world.check._rescore(step, pairs)
    budget = world.check.rescorer.budget_tokens
    try:
        world.check.rescorer.budget_tokens = 4096
        whole = world.check._rescore(step, pairs)
    finally:
        world.check.rescorer.budget_tokens = budget
    assert sample.input_len > 2 * 100 and split[0, 0] == whole[0, 0] > 200
    assert abs(float(split[0, 2]) - float(whole[0, 2])) < 1e-5 and abs(float(split[0, 3]) - float(whole[0, 3])) < 1e-6


def test_evidence_failures(world: World) -> None:
    rng = np.random.default_rng(4)
    bad_sha = honest(world, rng, "bad-sha", 1, worker_id="e1")
    bad_sha[0].served = [served_for(1, world.sha[2])]
    no_evidence = honest(world, rng, "no-evidence", 2, worker_id="e2")
    no_evidence[0].served = []
    first = honest(world, rng, "first", 1, worker_id="e3")  # lora_id 7 names v1 in worker e3 ...
    first[0].served = [served_for(1, world.sha[1], lora_id=7)]
    reused = honest(world, rng, "reused", 2, worker_id="e3")  # ... then v2
    reused[0].served = [served_for(2, world.sha[2], lora_id=7)]
    other_worker = honest(world, rng, "other-worker", 2, worker_id="e4")
    other_worker[0].served = [served_for(2, world.sha[2], lora_id=7)]
    restarted = honest(world, rng, "restarted", 2, worker_id="e3")  # e3 again, a new process (the broker's session)
    restarted[0].served = [served_for(2, world.sha[2], lora_id=7)]
    restarted[0].worker_session = "second-process"
    assert run(world, [bad_sha, no_evidence, first, reused, other_worker, restarted]) == [
        ("bad-sha", "adapter_sha256"), ("no-evidence", "no_evidence"), ("reused", "lora_id_reused")]


def test_the_engine_agreement_figure_counts_only_the_groups_kept(world: World) -> None:
    """A group failed by its evidence whose log-probs still pass the comparison (a stale LoRA id serving a
    neighbouring version differs by less than the tolerance) is no measure of a healthy engine's agreement:
    ``max_passing_diff`` is taken over the groups kept (it once reported such a group's 8.5e-3 nats)."""
    rng = np.random.default_rng(7)
    kept = honest(world, rng, "kept", 1, worker_id="k1")
    failed = honest(world, rng, "failed", 1, worker_id="k2")
    failed[0].served = [served_for(1, world.sha[2])]  # the evidence names another version's weights
    failed[1][2] = ("logprobs", failed[1][2][1] - np.float32(0.005))  # 0.005 nats off: under the 0.01 tolerance
    verdict = world.check.run(data.decode_step_batch(encode_groups([kept, failed])))
    assert [(m.group_id, m.reason) for m in verdict.mismatches] == [("failed", "adapter_sha256")]
    assert verdict.max_passing_diff < 1e-4, verdict.max_passing_diff


def test_lora_id_memory_is_bounded() -> None:
    ids = LoraIds(ids_per_worker=2, max_workers=2)
    assert ids.claim("a", 1, 1) is None and ids.claim("a", 1, 1) is None
    assert ids.claim("a", 1, 2) == 1
    ids.claim("a", 2, 2)
    ids.claim("a", 3, 3)  # id 1 forgotten
    assert ids.claim("a", 1, 5) is None
    ids.claim("b", 1, 1)
    ids.claim("c", 1, 1)  # worker a forgotten
    assert ids.claim("a", 2, 9) is None and ids.claim("c", 1, 4) == 1


def test_a_version_the_history_does_not_hold_is_unverifiable_and_passes(world: World) -> None:
    rng = np.random.default_rng(5)
    group = wrong(world, rng, "old", claimed=1, scored_by=1, change=lambda r, lp: np.full_like(lp, -0.5))
    group[1][3] = ("versions", np.full_like(group[1][3][1], 9))  # a version from before a restart
    group[0].min_version = group[0].max_version = 9
    group[0].served = [served_for(9, "f" * 64)]
    verdict = world.check.run(data.decode_step_batch(encode_groups([group])))
    assert verdict.mismatches == [] and verdict.num_unverifiable_tokens == 2 * 12
    assert verdict.num_checked_tokens == 0


def test_two_ranks_agree_and_drop_the_bad_groups(tiny_model_dir: Path) -> None:
    stdout = run_ranks("integrity_ranks.py", 2, str(tiny_model_dir))
    assert "integrity ok on 2 ranks: kept ['good-0', 'good-1', 'good-long'], dropped [('made-up', 'logprobs'), " \
           "('bad-sha', 'adapter_sha256'), ('made-up-long', 'logprobs')]" in stdout
    assert "trust ok on 2 ranks: " in stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_learner_loop_drops_a_failed_group_reports_it_and_trains_the_rest(tiny_model_dir: Path, tmp_path: Path,
                                                                              ranks: int) -> None:
    """A learner (one process, or 2 ranks under torchrun) fed two batches of two honest v0 groups and one made-up group each: the made-up one
    is not trained, not acknowledged, reported in the BatchAck's mismatches, counted and timed in metrics."""
    from tests.learner.scripted import ScriptedBroker
    from tests.learner.test_learner_runs import learner_argv, metrics_lines
    from tests.support import Processes

    rng = np.random.default_rng(6)
    base = Scorer(tiny_model_dir)
    batches = []
    for index in range(2):
        groups = [rollout_group(f"{index}:{k}", sample_group(base, rng, group_size=4, version=0), [served_for(0, "")])
                  for k in range(2)]
        made_up = sample_group(base, rng, group_size=4, version=0)
        for s in made_up:
            s.logprobs = np.full_like(s.logprobs, -0.5)
        groups.append(rollout_group(f"{index}:bad", made_up, [served_for(0, "")], worker_id="liar"))
        batches.append(encode_groups(groups, batch_id=f"batch-{index}"))
    broker = ScriptedBroker(batches=batches)
    procs = Processes(tmp_path)
    try:
        proc = procs.spawn("learner", learner_argv(tmp_path / "run", broker.endpoint, tiny_model_dir,
                                                   "run.num_steps=2", "learner.checkpoint_every=0",
                                                   "integrity.check=true", ranks=ranks))
        assert proc.wait(240) == 0, proc.log()[-4000:]
    finally:
        broker.close()
        procs.cleanup()
    assert [a.group_ids for a in broker.acks] == [["0:0", "0:1"], ["1:0", "1:1"]]
    assert [[(m.group_id, m.worker_id, m.reason) for m in a.mismatches] for a in broker.acks] == [
        [("0:bad", "liar", "logprobs")], [("1:bad", "liar", "logprobs")]]
    assert all(m.num_off == m.num_checked > 0 for a in broker.acks for m in a.mismatches)
    lines = metrics_lines(tmp_path / "run")
    assert [m["skipped"] for m in lines] == [{"policy_mismatch": 1}] * 2
    assert all(m["num_groups_trained"] == 2 and m["integrity_s"] > 0 and m["integrity_tokens"] == 3 * 12  # one sample of each group (integrity.samples_per_group = 1)
               for m in lines)
    # step 1 trains from v0, the groups' version: the training forward checks them, the step is redone without the
    # made-up group; step 2 trains from v1: the v0 groups are re-scored (one forward per rank) before the step
    assert [(m["integrity_free_tokens"], m["integrity_redone"]) for m in lines] == [(3 * 12, 1), (0, 0)]
    assert lines[0]["integrity_forwards"] == 0 and lines[1]["integrity_forwards"] == 1
    assert proc.log().count("policy_mismatch") >= 2


def test_a_resumed_learner_checks_the_version_of_its_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Stopped after publishing v1 (checkpointed), restarted with resume: it holds v1's weights and hash again,
    so honest v1 groups pass and one naming another hash fails adapter_sha256."""
    from peft import LoraConfig

    from tests.learner.scripted import ScriptedBroker
    from tests.learner.test_learner_runs import learner_argv
    from tests.support import Processes

    rng = np.random.default_rng(7)
    base = Scorer(tiny_model_dir)
    batches = [encode_groups([rollout_group(f"0:{k}", sample_group(base, rng, group_size=4, version=0),
                                            [served_for(0, "")]) for k in range(2)], batch_id="batch-0")]
    broker = ScriptedBroker(batches=batches)
    procs = Processes(tmp_path)
    argv = learner_argv(tmp_path / "run", broker.endpoint, tiny_model_dir, "run.num_steps=1",
                        "learner.checkpoint_every=1", "integrity.check=true")
    try:
        first = procs.spawn("first", argv)
        assert first.wait(240) == 0, first.log()[-4000:]
        v1 = broker.published[-1]
        assert v1.version == 1
        config = v1.adapter_config
        scorer = Scorer(tiny_model_dir, [(n, torch.from_numpy(t)) for n, t in v1.tensors.items()],
                        LoraConfig(r=config["r"], lora_alpha=config["lora_alpha"],
                                   target_modules=config["target_modules"], task_type="CAUSAL_LM"))
        groups = [rollout_group(f"1:{k}", sample_group(scorer, rng, group_size=4, version=1),
                                [served_for(1, v1.sha256 if k < 2 else "0" * 64)]) for k in range(3)]
        batches.append(encode_groups(groups, batch_id="batch-1"))
        second = procs.spawn("second", [*argv, "--set", "run.num_steps=2"])  # the later setting wins
        assert second.wait(240) == 0, second.log()[-4000:]
    finally:
        broker.close()
        procs.cleanup()
    assert [a.group_ids for a in broker.acks] == [["0:0", "0:1"], ["1:0", "1:1"]]
    assert [(m.group_id, m.reason) for m in broker.acks[-1].mismatches] == [("1:2", "adapter_sha256")]


# -- probation and audits (loraflow.learner.trust) ---------------------------------------------------------------------


def trusting_check(world: World, *, probation: int, audit_fraction: float) -> IntegrityCheck:
    """A check of its own (its own trust), holding the version the world's parameters hold now (v2)."""
    config = load_config(None, OVERRIDES + [f"integrity.probation_groups={probation}",
                                            f"integrity.audit_fraction={audit_fraction}"])
    check = IntegrityCheck(config, world.policy, world.parallel)
    check.record(2, world.sha[2])
    return check


def step_of(check: IntegrityCheck, groups: list, *, session: str = "s1"):
    """One step's verdict as the learner loop reaches it (run, then settle), the groups from process ``session``."""
    for group, _ in groups:
        group.worker_session = session
    step = data.decode_step_batch(encode_groups(groups))
    verdict = check.run(step)
    check.settle(step, verdict)
    return verdict


NEVER = 1e-9  # an audit_fraction no test run draws


def test_a_worker_is_re_scored_on_every_group_until_trusted_then_on_audited_steps_only(world: World) -> None:
    """On probation every group is re-scored; after probation_groups passes in a row its older versions are not
    (counted unaudited), while its evidence still is; a fresh process of the same worker starts on probation."""
    check = trusting_check(world, probation=3, audit_fraction=NEVER)
    rng = np.random.default_rng(11)
    for k in range(3):
        verdict = step_of(check, [honest(world, rng, f"p-{k}", 2)])
        assert verdict.num_forwards == 1 and verdict.num_unaudited_tokens == 0 and not verdict.mismatches
    assert not check.trust.on_probation("w#s1") and check.trust.num_trusted() == 1
    verdict = step_of(check, [honest(world, rng, "trusted", 2)])
    assert verdict.num_forwards == 0 and verdict.num_checked_tokens == 0 and not verdict.audited
    assert verdict.num_unaudited_tokens == 2 * 12  # integrity.samples_per_group = 2, 12 tokens each
    bad_sha = rollout_group("bad-sha", sample_group(world.scorers[2], rng, group_size=4, version=2),
                            [served_for(2, "0" * 64)])
    assert [m.reason for m in step_of(check, [bad_sha]).mismatches] == ["adapter_sha256"]  # evidence: every step
    assert check.trust.on_probation("w#s1")  # a failure: back on probation
    verdict = step_of(check, [honest(world, rng, "restarted", 2)], session="s2")
    assert verdict.num_forwards == 1  # another process of the same worker id: on probation


def test_a_step_that_re_scores_for_a_worker_on_probation_re_scores_every_group(world: World) -> None:
    """The forward runs anyway, and costs about the same with the trusted workers' rows in it."""
    check = trusting_check(world, probation=1, audit_fraction=NEVER)
    rng = np.random.default_rng(14)
    step_of(check, [honest(world, rng, "p", 2)])
    made_up = wrong(world, rng, "made-up", claimed=2, scored_by=2, change=lambda r, lp: np.full_like(lp, -0.5))
    made_up[0].worker_id = "w"
    newcomer = honest(world, rng, "newcomer", 2, worker_id="new")
    verdict = step_of(check, [made_up, newcomer])
    assert verdict.audited and verdict.num_forwards == 1 and verdict.num_unaudited_tokens == 0
    assert [(m.group_id, m.reason) for m in verdict.mismatches] == [("made-up", "logprobs")]


def test_a_trusted_worker_that_turns_dishonest_is_caught_on_an_audited_step(world: World) -> None:
    """Made-up log-probs from a trusted worker pass an unaudited step (the rule's price, counted as unaudited
    tokens) and fail the next audited one; the worker is then on probation, every group re-scored again."""
    check = trusting_check(world, probation=2, audit_fraction=NEVER)
    rng = np.random.default_rng(12)
    for k in range(2):
        step_of(check, [honest(world, rng, f"p-{k}", 2)])
    made_up = wrong(world, rng, "made-up", claimed=2, scored_by=2, change=lambda r, lp: np.full_like(lp, -0.5))
    made_up[0].worker_id = "w"
    verdict = step_of(check, [made_up])
    assert not verdict.mismatches and verdict.num_unaudited_tokens > 0
    check.trust.audit_fraction = 1.0  # the next step is drawn for an audit
    made_up = wrong(world, rng, "made-up-2", claimed=2, scored_by=2, change=lambda r, lp: np.full_like(lp, -0.5))
    made_up[0].worker_id = "w"
    verdict = step_of(check, [made_up, honest(world, rng, "beside", 2, worker_id="other")])
    assert verdict.audited and [(m.group_id, m.reason) for m in verdict.mismatches] == [("made-up-2", "logprobs")]
    assert check.trust.on_probation("w#s1")
    check.trust.audit_fraction = NEVER
    assert step_of(check, [honest(world, rng, "after", 2)]).num_forwards == 1  # on probation: re-scored


def test_the_free_path_checks_a_trusted_worker_every_step(world: World) -> None:
    """Tokens of the version the parameters hold are checked from the training forward whatever the trust: a
    trusted worker's group of that version counts as compared (it keeps its trust by passing it)."""
    check = trusting_check(world, probation=1, audit_fraction=NEVER)
    rng = np.random.default_rng(13)
    step_of(check, [honest(world, rng, "p", 2)])
    assert not check.trust.on_probation("w#s1")
    groups = [honest(world, rng, "free", 2)]
    groups[0][0].worker_session = "s1"
    step = data.decode_step_batch(encode_groups(groups))
    verdict = check.run(step, defer_version=2)  # v2 left to the training forward
    assert verdict.num_forwards == 0 and verdict.num_unaudited_tokens == 0
    watch = TrainedCheck(check, step, 2)
    assert len(watch.pairs) == 2  # the chosen samples' v2 tokens are watched in the training forward
