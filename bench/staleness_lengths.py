"""Drop rate by completion length under the two staleness rules: a group's oldest token decides (before) or its
newest token decides and older tokens are masked in the learner (after), same seed, one run.

    .venv/bin/python -m bench.staleness_lengths [--groups 600] [--mean-tokens 256] [--seed 0]

The real code in process, on an explicit clock (no sockets, no model): the broker core (admission, leases, the
arrival judge, the buffer's stale drops, batching) with ``ledger.staleness_rule`` set per run; one worker's
``Rollouts`` over the sim backend (lognormal lengths, ``continue`` policy, one *round* = one chunk for every ready
sample), its adapter moved to each new version ``--fetch-rounds`` after the publish; the learner's real
``select_groups`` and ``mask_stale_tokens``, a step every ``--step-rounds`` rounds.

A sample attempt is *dropped* when none of its tokens is trained for staleness (its group refused or dropped, or
every trained token masked); a dropped prompt is leased again at the same length (the sim's lengths follow the
group id). Zero-variance groups are left out. The JSON line's value is the after drop rate of the longest length
quartile over the shortest's, its reference the same ratio before.
"""

from __future__ import annotations

import argparse
import collections
import math
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench import harness
from bench.harness import codec
from loraflow.broker.core import BrokerCore
from loraflow.broker.ledger import State
from loraflow.broker.prompts import parse_group_id
from loraflow.common import framing
from loraflow.common.config import load_config
from loraflow.common.logging import setup_logging
from loraflow.common.protocol import AdapterUpdate, Batch, BatchAck, BatchRequest, Hello, Kind, LeaseRequest
from loraflow.common.tasks import load_task
from loraflow.common.versions import StalenessRule
from loraflow.learner import data
from loraflow.learner.data import mask_stale_tokens
from loraflow.rollout_worker.adapters import WEIGHTS_FILE, ReceivedAdapter, write_safetensors
from loraflow.rollout_worker.backends import make_backend
from loraflow.rollout_worker.envs import EnvResolver
from loraflow.rollout_worker.rollout import Rollouts
from loraflow.rollout_worker.samples import IN_ENV

WORKER, LEARNER = b"worker/w", b"learner/l"
ROUND_S = 0.01  # the broker's clock advances this much per round (leases and heartbeats never run out)
#: the flags and their defaults (``--quick``: 40 groups, mean 32 tokens, cap 256)
FLAGS = {"groups": 600, "group_size": 8, "groups_per_step": 4, "max_staleness": 1,
         "mean_tokens": 256.0,  # lognormal mean of completion lengths
         "sigma": 1.0,  # lognormal sigma (the tail)
         "max_tokens": 4096, "chunk_tokens": 32,  # tokens per sample per round
         "worker_groups": 16,  # leases the worker holds at most
         "step_rounds": 4, "fetch_rounds": 1,  # rounds of a learner step; from a publish to the worker's load
         "max_rounds": 200_000, "seed": 0}


def reward(completion: str, answer: Any, **_: Any) -> float:
    """A made-up 0/1 reward (the sim's tokens answer nothing): groups have a gradient, as real ones mostly do."""
    return float(zlib.crc32(completion.encode()) & 1)


@dataclass(slots=True)
class Attempt:
    group_id: str
    lens: list[int]
    fate: str = "pending"  # pending, accepted, dropped, trained, zero_variance, refused
    trained: list[int] = field(default_factory=list)  # per sample: completion tokens trained


@dataclass(slots=True)
class Outcome:
    attempts: list[Attempt]
    versions: int
    rounds: int
    dropped: dict[str, int]
    tokens_masked: int


def run(rule: StalenessRule, args: argparse.Namespace, adapter_dir: Path) -> Outcome:
    config = load_config(None, [
        f"run.group_size={args.group_size}", f"run.groups_per_step={args.groups_per_step}",
        f"run.max_staleness={args.max_staleness}", f"run.seed={args.seed}", "run.task=arith",
        "broker.heartbeat_interval_s=60", "broker.heartbeat_misses=100", "broker.lease_timeout_s=100000",
        f"broker.max_leases_per_worker={args.worker_groups}", "worker.backend=sim",
        "worker.partial_policy=continue", f"worker.chunk_tokens={args.chunk_tokens}",
        f"worker.max_new_tokens={args.max_tokens}", f"worker.sim.mean_tokens={args.mean_tokens}",
        f"worker.sim.length_sigma={args.sigma}", f"worker.sim.max_tokens={args.max_tokens}",
        "worker.sim.tokens_per_s=1e12", f"model.max_seq_len={args.max_tokens + 256}"])
    now = 1000.0
    core = BrokerCore(config, task=load_task(config.run.task, config.run.seed), vocab_size=config.worker.sim.vocab_size,
                      now_s=now)
    core.ledger.staleness_rule = rule
    backend = make_backend(config, worker_id="w", max_staleness=args.max_staleness)
    rollouts = Rollouts(backend, EnvResolver(""), config.worker, worker_id="w", max_seq_len=config.model.max_seq_len,
                        reward_fn=reward)
    attempts: list[Attempt] = []
    current: dict[str, Attempt] = {}  # group id -> its newest attempt
    accepted: set[str] = set()  # group ids of attempts buffered (or in training) at the broker
    inbox: list[tuple[bytes, Any, Any]] = []

    def send(identity: bytes, record: Any, tensors: Any = ()) -> None:
        core.handle(identity, codec.encode(record, list(tensors)), now)
        while True:
            core.tick(now)
            for out in core.flush(now):
                inbox.append((out.identity, *codec.decode(out.frames)))
            if not core.outbox.num_awaiting and not core.has_work(now):
                break
        for group_id in list(accepted):  # a buffered group the broker dropped: its prompt is pending again
            if core.ledger.state(parse_group_id(group_id)) in (State.QUEUED, State.LEASED):
                current[group_id].fate = "dropped"
                accepted.discard(group_id)
            elif current[group_id].fate != "accepted":  # the learner decided
                accepted.discard(group_id)

    def take(identity: bytes, kind: Kind) -> list[tuple[Any, Any]]:
        mine = [(r, e) for i, r, e in inbox if i == identity and r.KIND == kind]
        inbox[:] = [m for m in inbox if not (m[0] == identity and m[1].KIND == kind)]
        return mine

    send(WORKER, Hello(role="worker", client_id="w", session="s"))
    send(LEARNER, Hello(role="learner", client_id="l", session="s"))
    inbox.clear()
    version, trained_ids, tokens_masked = 0, set(), 0
    step_done_at, pending_batch = None, None  # the learner's step in progress: (round it ends, batch frames)
    loads: list[tuple[int, int, Path, str]] = []  # (round, version, path, sha256) the worker loads at
    rng = np.random.default_rng(args.seed)
    rounds = 0
    while sum(a.fate in ("trained", "zero_variance") for a in attempts) < args.groups and rounds < args.max_rounds:
        rounds += 1
        now += ROUND_S
        while loads and loads[0][0] <= rounds:
            _, v, path, sha = loads.pop(0)
            backend.add_adapter(ReceivedAdapter(version=v, sha256=sha, path=path, config={"r": 1}, num_bytes=0,
                                                received_unix=0.0))
            backend.retain(rollouts.versions_in_use() | {v})
        # the worker: leases up to its share, one chunk round, every finished turn's environment step collected
        if rollouts.num_groups < args.worker_groups:
            send(WORKER, LeaseRequest(max_leases=args.worker_groups - rollouts.num_groups,
                                      adapter_version=backend.newest_version, wait_ms=0))
        for grant, _ in take(WORKER, Kind.LEASE_GRANT):
            for lease in grant.leases:
                rollouts.add(lease)
        finished = rollouts.step()
        while any(s.status == IN_ENV for g in rollouts.groups.values() for s in g.samples):
            rollouts.wake.wait(1.0)
            rollouts.wake.clear()
            finished += rollouts.poll()
        for group in finished:
            attempt = Attempt(group.group.group_id, list(group.group.completion_lens))
            attempts.append(attempt)
            current[attempt.group_id] = attempt
            stale_before = core.stats.families["dropped"][1]["stale_on_arrival"]
            send(WORKER, group.group, group.tensors)
            acks = take(WORKER, Kind.ACK)
            take(WORKER, Kind.ERROR)
            if acks:
                attempt.fate = "accepted"
                accepted.add(attempt.group_id)
            else:
                stale = core.stats.families["dropped"][1]["stale_on_arrival"] > stale_before
                attempt.fate = "dropped" if stale else "refused"
        take(WORKER, Kind.ADAPTER_NOTICE)
        # the learner: a step ends (ack, publish), or a new one starts when a batch is buffered
        if step_done_at is not None and rounds >= step_done_at:
            batch_id, ack_ids = pending_batch
            send(LEARNER, BatchAck(batch_id=batch_id, step=version + 1, trained_version=version, group_ids=ack_ids))
            version += 1
            tensors = [("lora_A", rng.standard_normal(16).astype(np.float32))]
            frames = codec.encode(AdapterUpdate(version=version, step=version, sha256="", adapter_config={"r": 1}),
                                  tensors)
            sha = framing.frames_sha256(frames[2:])
            send(LEARNER, AdapterUpdate(version=version, step=version, sha256=sha, adapter_config={"r": 1}), tensors)
            path = adapter_dir / f"{rule}-v{version}"
            path.mkdir()
            _, envelope = codec.decode(frames)
            write_safetensors(path / WEIGHTS_FILE, envelope.specs, envelope.frames)
            loads.append((rounds + args.fetch_rounds, version, path, sha))
            step_done_at, pending_batch = None, None
        take(LEARNER, Kind.ACK)
        if step_done_at is None and core.ledger.buffer.num_buffered >= args.groups_per_step:
            send(LEARNER, BatchRequest(num_groups=args.groups_per_step, wait_ms=0, learner_version=version))
            for batch, envelope in take(LEARNER, Kind.BATCH):
                if not batch.groups:
                    continue
                masked, ack_ids = learn(batch, envelope, version, args.max_staleness, trained_ids, current)
                tokens_masked += masked
                pending_batch = (batch.batch_id, ack_ids)
                step_done_at = rounds + args.step_rounds
    stats = core.stats.families["dropped"][1]
    return Outcome(attempts=attempts, versions=version, rounds=rounds, dropped=dict(stats), tokens_masked=tokens_masked)


def learn(batch: Batch, envelope: Any, version: int, max_staleness: int, trained_ids: set[str],
          current: dict[str, Attempt]) -> tuple[int, list[str]]:
    """The learner's decisions on one batch (its real selection and token mask): (tokens masked, group ids to
    acknowledge)."""
    selection = data.select_groups(batch, envelope.specs, envelope.frames, version=version,
                                   max_staleness=max_staleness, trained_group_ids=trained_ids, vocab_size=256)
    for group_id in selection.skipped_ids.get("stale", []):
        current[group_id].fate = "dropped"
    for group_id in selection.skipped_ids.get("zero_variance", []):
        current[group_id].fate = "zero_variance"
    trained_ids.update(selection.ack_group_ids)
    frames = data.trainable_frames(batch, envelope.specs, envelope.frames, selection.train)
    step = data.decode_step_batch([bytearray(f) for f in frames])
    masked = mask_stale_tokens(step, version, max_staleness)
    per_group: dict[int, list[int]] = collections.defaultdict(list)
    for sample in step.samples:
        per_group[sample.group].append(sample.num_trained)
    for g, group_id in enumerate(step.group_ids):
        attempt = current[group_id]
        attempt.fate, attempt.trained = "trained", per_group[g]
    return masked, selection.ack_group_ids


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Rank correlation (tied values get their mean rank)."""
    def ranks(a: np.ndarray) -> np.ndarray:
        _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
        return (np.cumsum(counts) - (counts + 1) / 2)[inverse]
    rx, ry = ranks(x), ranks(y)
    return 0.0 if rx.std() == 0 or ry.std() == 0 else float(np.corrcoef(rx, ry)[0, 1])


def per_sample(outcome: Outcome) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(length, dropped, tokens trained, its group's longest sample) of every sample attempt with a decided fate
    (zero-variance ones out)."""
    rows = [(n, attempt.fate == "dropped" or done == 0, done, max(attempt.lens))
            for attempt in outcome.attempts if attempt.fate in ("dropped", "trained")
            for k, n in enumerate(attempt.lens)
            for done in [attempt.trained[k] if attempt.fate == "trained" else 0]]
    lens, dropped, trained, longest = zip(*rows, strict=True) if rows else ((), (), (), ())
    return np.array(lens), np.array(dropped, dtype=bool), np.array(trained), np.array(longest)


def per_group(outcome: Outcome) -> tuple[np.ndarray, np.ndarray]:
    """(longest sample, dropped: no token trained) of every group attempt with a decided fate."""
    decided = [a for a in outcome.attempts if a.fate in ("dropped", "trained")]
    return (np.array([max(a.lens) for a in decided]),
            np.array([a.fate == "dropped" or not any(a.trained) for a in decided], dtype=bool))


def quartile_rates(lens: np.ndarray, flags: np.ndarray, edges: np.ndarray) -> list[tuple[float, int]]:
    """(mean of ``flags``, count) per length quartile given its three inner edges."""
    which = np.searchsorted(edges, lens, side="left")  # 0..3; a length equal to an edge goes below it
    return [(float(flags[which == q].mean()) if (which == q).any() else float("nan"), int((which == q).sum()))
            for q in range(4)]


def main(argv: list[str] | None = None) -> None:
    args = harness.parse(harness.flags(harness.parser(__doc__), FLAGS), argv, groups=40, mean_tokens=32.0,
                         max_tokens=256)
    setup_logging("bench", level="warning")
    with tempfile.TemporaryDirectory() as tmp:
        before, after = (run(rule, args, Path(tmp)) for rule in (StalenessRule.OLDEST_TOKEN, StalenessRule.NEWEST_TOKEN))
    runs = {"before": before, "after": after}
    for name, o in runs.items():
        print(f"{name}: {len(o.attempts)} group attempts over {o.rounds} rounds, {o.versions} versions; fates "
              f"{dict(collections.Counter(a.fate for a in o.attempts))}; broker dropped {o.dropped}; learner masked "
              f"{o.tokens_masked} tokens")
    samples = {name: per_sample(o) for name, o in runs.items()}
    edges = np.quantile(np.concatenate([s[0] for s in samples.values()]), [0.25, 0.5, 0.75])
    rates = {name: quartile_rates(s[0], s[1], edges) for name, s in samples.items()}
    untrained = {}
    for name, (lens, _, trained, _) in samples.items():
        which = np.searchsorted(edges, lens, side="left")
        untrained[name] = [1 - trained[which == q].sum() / max(lens[which == q].sum(), 1) for q in range(4)]
    print(f"\nsamples by completion length, quartile edges {[int(e) for e in edges]} tokens")
    harness.table(("quartile", "dropped before", "after", "tokens not trained before", "after", "samples before / after"),
                  [(f"Q{q + 1}", f"{rates['before'][q][0]:.3f}", f"{rates['after'][q][0]:.3f}",
                    f"{untrained['before'][q]:.3f}", f"{untrained['after'][q]:.3f}",
                    f"{rates['before'][q][1]} / {rates['after'][q][1]}") for q in range(4)])
    groups = {name: per_group(o) for name, o in runs.items()}
    group_edges = np.quantile(np.concatenate([g[0] for g in groups.values()]), [0.25, 0.5, 0.75])
    group_rates = {name: quartile_rates(*g, group_edges) for name, g in groups.items()}
    print(f"\ngroups by their longest sample, quartile edges {[int(e) for e in group_edges]} tokens")
    harness.table(("quartile", "groups dropped before", "after", "groups before / after"),
                  [(f"Q{q + 1}", f"{group_rates['before'][q][0]:.3f}", f"{group_rates['after'][q][0]:.3f}",
                    f"{group_rates['before'][q][1]} / {group_rates['after'][q][1]}") for q in range(4)])
    rho = {name: spearman(s[0].astype(float), s[1].astype(float)) for name, s in samples.items()}
    siblings = {}  # dropped Q1-Q3 samples whose group's longest sample is in the longest group quartile
    for name, (lens, dropped, _, longest) in samples.items():
        short = dropped & (lens <= edges[2])
        siblings[name] = float((longest[short] > group_edges[2]).mean()) if short.any() else float("nan")
    print(f"\nSpearman(length, dropped): before {rho['before']:+.3f}, after {rho['after']:+.3f}; short drops with a "
          f"long sibling: before {siblings['before']:.1%}, after {siblings['after']:.1%}")

    def q4_over_q1(r: list[tuple[float, int]]) -> float:
        return r[3][0] / r[0][0] if r[0][0] > 0 else (math.inf if r[3][0] > 0 else 1.0)

    value, reference = q4_over_q1(rates["after"]), q4_over_q1(rates["before"])
    by_quartile = {f"{kind}drop_rate_by_quartile_{name}": [round(r, 4) for r, _ in table[name]]
                   for kind, table in (("", rates), ("group_", group_rates)) for name in runs}
    harness.report("staleness_lengths", "drop rate, longest / shortest length quartile (newest-token rule)", value,
                   "x", reference, ratio=value / reference if reference and math.isfinite(reference) else float("nan"),
                   spearman_before=round(rho["before"], 4), spearman_after=round(rho["after"], 4),
                   quartile_edges=[int(e) for e in edges], tokens_masked_after=after.tokens_masked,
                   rounds_before=before.rounds, rounds_after=after.rounds, **by_quartile,
                   short_drops_with_a_long_sibling_before=round(siblings["before"], 4),
                   short_drops_with_a_long_sibling_after=round(siblings["after"], 4))


if __name__ == "__main__":
    main()
