"""Drop rate by completion length, under the staleness rule before (a group's oldest token decides) and after (its
newest token decides; older tokens are masked in the learner), in one run (issue 13, long generations).

    .venv/bin/python -m bench.staleness_lengths [--groups 600] [--mean-tokens 256] [--sigma 1.0] [--max-staleness 1]
        [--plot drops.png]

Both runs drive the real code in process, with the same seed and an explicit clock (no sockets, no model):

- the broker: :class:`loraflow.broker.core.BrokerCore` (admission, leases, ``loraflow.broker.intake.judge`` on arrival, the buffer's
  stale drops, batching), its ledger's ``staleness_rule`` set to ``OLDEST_TOKEN`` for "before" (the rule until
  issue 13) and left at its default ``NEWEST_TOKEN`` for "after";
- one rollout worker: :class:`loraflow.rollout_worker.rollout.Rollouts` over the sim backend (lognormal completion lengths,
  ``--mean-tokens`` / ``--sigma``, capped at ``--max-tokens``; ``partial_policy = "continue"``; one *round* is one
  chunk of ``--chunk-tokens`` for every ready sample), holding up to ``--worker-groups`` leases, its adapter moved
  to each new version ``--fetch-rounds`` after it is published;
- the learner: takes a batch of ``--groups-per-step`` groups when the buffer holds one, decides with
  ``loraflow.learner.data.select_groups`` and ``loraflow.learner.train.mask_stale_tokens`` at its version, acknowledges the batch and
  publishes the next version ``--step-rounds`` rounds later (so versions advance while long samples generate).

A *sample attempt* is one generated completion that reached the broker. It is *dropped* when none of its tokens is
trained because of staleness: its group refused as stale on arrival, dropped stale from the buffer, skipped stale
by the learner, or (after) every trained token of it masked. A dropped group's prompt is leased again and, the
sim's lengths being a function of the group id, generated at the same length: what a long answer costs under a
rule that drops it. Attempts of groups without a gradient (all rewards equal) are left out of the table.

Printed side by side: per length quartile (edges from both runs' attempts together) the drop rate and the share
of completion tokens not trained, before and after. The JSON line's value is the after drop rate of the longest
quartile over the shortest's, its reference the same ratio before; ``spearman_before`` / ``_after`` are the rank
correlations of sample length with being dropped.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench import harness
from bench.harness import codec
from bench.report import report
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
from loraflow.learner.train import mask_stale_tokens
from loraflow.rollout_worker.adapters import WEIGHTS_FILE, ReceivedAdapter, write_safetensors
from loraflow.rollout_worker.backends import make_backend
from loraflow.rollout_worker.envs import EnvResolver
from loraflow.rollout_worker.rollout import Rollouts
from loraflow.rollout_worker.samples import IN_ENV

WORKER, LEARNER = b"worker/w", b"learner/l"
ROUND_S = 0.01  # the broker's clock advances this much per round (leases and heartbeats never run out)


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
    """Rank correlation (average ranks for ties)."""
    def ranks(a: np.ndarray) -> np.ndarray:
        order = a.argsort(kind="stable")
        r = np.empty(len(a))
        r[order] = np.arange(len(a))
        for value in np.unique(a):  # ties: their mean rank
            tied = a == value
            r[tied] = r[tied].mean()
        return r
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])


def per_sample(outcome: Outcome) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(length, dropped, tokens trained, its group's longest sample) of every sample attempt with a decided fate
    (zero-variance ones out)."""
    lens, dropped, trained, longest = [], [], [], []
    for attempt in outcome.attempts:
        if attempt.fate not in ("dropped", "trained"):
            continue
        for k, n in enumerate(attempt.lens):
            done = attempt.trained[k] if attempt.fate == "trained" else 0
            lens.append(n)
            trained.append(done)
            dropped.append(attempt.fate == "dropped" or done == 0)
            longest.append(max(attempt.lens))
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


def plot(path: Path, sample_rates: dict[str, list[float]], group_before: list[float], group_after: list[float],
         edges: np.ndarray, group_edges: np.ndarray) -> None:
    """Drop rate by length quartile, before / after, for samples and for groups, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    panels = ((axes[0], sample_rates["before"], sample_rates["after"], edges, "samples, by completion length"),
              (axes[1], group_before, group_after, group_edges, "groups, by their longest sample"))
    for ax, before, after, bounds, title in panels:
        x = np.arange(4)
        ax.bar(x - 0.2, before, 0.4, label="before: oldest token decides")
        ax.bar(x + 0.2, after, 0.4, label="after: newest token decides, older masked")
        labels = [f"Q{q + 1}\n{lo}-{hi}" for q, (lo, hi) in
                  enumerate(zip(["0", *map(str, map(int, bounds))], [*map(str, map(int, bounds)), "max"],
                                strict=True))]
        ax.set_xticks(x, labels)
        ax.set_title(title)
        ax.set_xlabel("length quartile (tokens)")
    axes[0].set_ylabel("drop rate (nothing trained)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"figure: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--groups", type=int, default=600, help="groups to reach the learner per run")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--mean-tokens", type=float, default=256.0, help="lognormal mean of completion lengths")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma (the tail)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--chunk-tokens", type=int, default=32, help="tokens per sample per round")
    parser.add_argument("--worker-groups", type=int, default=16, help="leases the worker holds at most")
    parser.add_argument("--step-rounds", type=int, default=4, help="rounds one learner step takes")
    parser.add_argument("--fetch-rounds", type=int, default=1, help="rounds from a publish to the worker's load")
    parser.add_argument("--max-rounds", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, help="also draw the two tables as bar charts into this PNG")
    args = harness.parse(parser, argv, groups=40, mean_tokens=32.0, max_tokens=256)
    setup_logging("bench", level="warning")
    outcomes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rule in (StalenessRule.OLDEST_TOKEN, StalenessRule.NEWEST_TOKEN):
            outcomes[rule] = run(rule, args, Path(tmp))
    before, after = outcomes[StalenessRule.OLDEST_TOKEN], outcomes[StalenessRule.NEWEST_TOKEN]
    samples = {name: per_sample(o) for name, o in (("before", before), ("after", after))}
    edges = np.quantile(np.concatenate([s[0] for s in samples.values()]), [0.25, 0.5, 0.75])
    print(f"sim backend, continue policy, lognormal lengths (mean {args.mean_tokens:g}, sigma {args.sigma:g}, cap "
          f"{args.max_tokens}), chunk {args.chunk_tokens} tokens/round, group_size {args.group_size}, "
          f"{args.groups_per_step} groups/step, a step every {args.step_rounds} rounds, max_staleness "
          f"{args.max_staleness}, worker holds {args.worker_groups} leases")
    for name, o in (("before (oldest token decides)", before), ("after (newest token decides, older masked)", after)):
        fates = collections.Counter(a.fate for a in o.attempts)
        print(f"  {name}: {len(o.attempts)} group attempts over {o.rounds} rounds, {o.versions} versions; "
              f"fates {dict(fates)}; broker dropped {o.dropped}; learner masked {o.tokens_masked} tokens")
    print(f"\nsamples: quartiles of completion length (tokens), edges {[int(e) for e in edges]}")
    print(f"{'quartile':>9} | {'drop rate before':>16} {'after':>6} | {'tokens not trained before':>25} {'after':>6} | "
          f"samples before / after")
    rates: dict[str, list[float]] = {}
    untrained: dict[str, list[float]] = {}
    for name, (lens, dropped, trained, _) in samples.items():
        rates[name] = [r for r, _ in quartile_rates(lens, dropped, edges)]
        which = np.searchsorted(edges, lens, side="left")
        untrained[name] = [1 - trained[which == q].sum() / max(lens[which == q].sum(), 1) for q in range(4)]
    counts = {name: [n for _, n in quartile_rates(s[0], s[1], edges)] for name, s in samples.items()}
    for q in range(4):
        print(f"{'Q' + str(q + 1):>9} | {rates['before'][q]:16.3f} {rates['after'][q]:6.3f} | "
              f"{untrained['before'][q]:25.3f} {untrained['after'][q]:6.3f} | "
              f"{counts['before'][q]:5d} / {counts['after'][q]:5d}   "
              f"{'#' * round(rates['before'][q] * 50):<25} {'#' * round(rates['after'][q] * 50)}")
    groups = {name: per_group(o) for name, o in (("before", before), ("after", after))}
    group_edges = np.quantile(np.concatenate([g[0] for g in groups.values()]), [0.25, 0.5, 0.75])
    group_rates = {name: quartile_rates(*g, group_edges) for name, g in groups.items()}
    print(f"\ngroups: quartiles of their longest sample (tokens), edges {[int(e) for e in group_edges]}")
    print(f"{'quartile':>9} | {'drop rate before':>16} {'after':>6} | groups before / after")
    for q in range(4):
        (rb, nb), (ra, na) = group_rates["before"][q], group_rates["after"][q]
        print(f"{'Q' + str(q + 1):>9} | {rb:16.3f} {ra:6.3f} | {nb:5d} / {na:5d}   "
              f"{'#' * round(rb * 50):<25} {'#' * round(ra * 50)}")
    if args.plot is not None:
        plot(args.plot, rates, [r for r, _ in group_rates["before"]], [r for r, _ in group_rates["after"]],
             edges, group_edges)
    rho = {name: spearman(s[0].astype(float), s[1].astype(float)) for name, s in samples.items()}
    print(f"\nSpearman(length, dropped): before {rho['before']:+.3f}, after {rho['after']:+.3f}")
    siblings = {}
    for name, (lens, dropped, _, longest) in samples.items():
        short = dropped & (lens <= edges[2])
        siblings[name] = float((longest[short] > group_edges[2]).mean()) if short.any() else float("nan")
    print(f"dropped samples of Q1-Q3 whose group's longest sample is in the longest group quartile (their tokens "
          f"aged while it generated): before {siblings['before']:.1%}, after {siblings['after']:.1%}")

    def q4_over_q1(r: list[float]) -> float:
        return r[3] / r[0] if r[0] > 0 else (math.inf if r[3] > 0 else 1.0)

    value, reference = q4_over_q1(rates["after"]), q4_over_q1(rates["before"])
    print(f"drop rate longest / shortest quartile: after {value:.3f}, before {reference:.3f}")
    report("staleness_lengths", "drop rate, longest / shortest length quartile (newest-token rule)", value, "x",
           reference, ratio=value / reference if reference and math.isfinite(reference) else float("nan"),
           drop_rate_by_quartile_before=[round(r, 4) for r in rates["before"]],
           drop_rate_by_quartile_after=[round(r, 4) for r in rates["after"]],
           spearman_before=round(rho["before"], 4), spearman_after=round(rho["after"], 4),
           quartile_edges=[int(e) for e in edges], tokens_masked_after=after.tokens_masked,
           group_drop_rate_by_quartile_before=[round(r, 4) for r, _ in group_rates["before"]],
           group_drop_rate_by_quartile_after=[round(r, 4) for r, _ in group_rates["after"]],
           rounds_before=before.rounds, rounds_after=after.rounds,
           short_drops_with_a_long_sibling_before=round(siblings["before"], 4),
           short_drops_with_a_long_sibling_after=round(siblings["after"], 4))
    return 0


if __name__ == "__main__":
    sys.exit(main())
