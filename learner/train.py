"""The learner loop: rollout batches in, one optimizer step per batch, adapter versions out.

    every rank                                         rank 0 only
    ----------                                         -----------
    wait     agree(stop?, batch ready?)  <-----------  poll the broker (long-poll, POLL_S slices);
             broadcast the batch's frames <-----------  select groups: skip trained / stale / invalid /
                                                        zero-variance ones (counted)
    mask     tokens older than version - max_staleness: loss mask 0 (data.mask_stale_tokens; a group is kept while its
             newest token is within the bound, loraflow.common.versions), counted as tokens_masked_stale
    check    the policy check (loraflow.learner.integrity): evidence, and chosen samples re-scored under the older
             versions they claim (no-grad forwards, collective); all ranks drop the same failed groups
    compute  own micro-batches: forward, token loss, backward (FSDP2 reduce-scatters the LoRA grads); the
             forward's log-probs check the chosen samples' tokens of the version the parameters hold; a group
             failing there: gradients dropped, forward/backward again without it (loraflow.learner.step.checked_train_step)
             clip grad norm, AdamW step, LR schedule  ----> rank 0: failed groups skipped policy_mismatch, logged,
                                                        in the BatchAck's mismatches
    publish  gather LoRA tensors (collective) ------->  AdapterUpdate v+1 to the broker, PEFT dir every N;
                                                        ask for the next batch right away
    checkpoint every n steps (DCP, collective)
                                                        BatchAck(batch, step, group ids, checkpoint version);
                                                        metrics line (loraflow.learner.metrics_log); heartbeat state

Consumes: Batch messages (rank 0, through :class:`loraflow.learner.session.BrokerSession`).
Produces: AdapterUpdate messages, BatchAcks, ``<run_dir>/learner/{metrics.jsonl, ledger.jsonl, adapters/,
checkpoints/}`` (the ledger line of a step is written before its checkpoint and its BatchAck,
:mod:`loraflow.learner.ledger`).
Blocks on: the broker's next batch (rank 0 polls in short slices; the other ranks wait in the ``agree``
collective meanwhile) and on collectives with the other ranks.
Unblocked by: a non-empty batch, a stop request on any rank (SIGTERM / SIGINT), or ``run.num_steps`` reached.
A stop is clean: the last step finishes, the final adapter is published and written as a PEFT directory, a
final checkpoint is saved, and the process exits 0.

Resuming after a crash: the steps after the newest checkpoint are lost with the process, and so are the
adapter versions published after it. The resumed learner says hello at its checkpoint's version ``c``. If
anything newer was published, up to ``v`` (the broker's latest version, an adapter directory on disk, or a
version this run's ledger says was sent, even one no broker received), the versions ``c+1..v`` are
*withdrawn*: it publishes its checkpoint's weights at once as version ``v+1`` (a number never used, so no
version ever names two sets of weights; workers move to it like to any new version), never trains a group
holding a token of ``c+1..v`` (skipped ``withdrawn``, not acknowledged), and keeps the ranges in its
checkpoints. The broker, seeing a learner of a new session, re-queues the groups trained after that checkpoint
and withdraws the same versions on its side (:mod:`loraflow.broker.history`).
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from loraflow.common import versions
from loraflow.common.config import Config
from loraflow.common.logging import get_logger
from loraflow.common.metrics import Metrics
from loraflow.common.protocol import Batch, BatchAck, reward_means_of
from loraflow.common.timeline import Timeline
from loraflow.learner import data, integrity, publish, tracking, verdicts
from loraflow.learner.checkpoint import Checkpointer, LearnerState
from loraflow.learner.ledger import Ledger
from loraflow.learner.loss import LossConfig
from loraflow.learner.metrics_log import MetricsLog
from loraflow.learner.model import Policy
from loraflow.learner.parallel import Parallel
from loraflow.learner.session import BrokerSession
from loraflow.learner.step import checked_train_step

log = get_logger("learner")

POLL_S = 0.2  # how often a waiting learner checks for a stop request
DRAIN_TIMEOUT_S = 5.0


@dataclass(slots=True, kw_only=True)
class Received:
    """A batch as rank 0 received it, and what it decided about its groups."""

    batch: Batch
    selection: data.Selection
    rewards: list[float]
    verdict: verdicts.Verdict | None = None  # the policy check's, once it ran


@dataclass(slots=True, kw_only=True)
class Timers:
    start: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0  # compute + publish + checkpoint, for the busy share
    wait_s: float = 0.0  # waiting for batches

    def busy_share(self) -> float:
        return self.busy_s / max(time.monotonic() - self.start, 1e-9)


class Learner:
    """The loop of one rank; rank 0 also owns the broker session, timeline and metrics file."""

    def __init__(self, config: Config, parallel: Parallel, policy: Policy, optimizer: torch.optim.Optimizer,
                 scheduler: Any, checkpointer: Checkpointer, state: LearnerState, session: BrokerSession | None,
                 metrics: Metrics, ledger: Ledger | None = None, timeline: Timeline | None = None,
                 turn: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        self.config = config
        self.turn = turn  # held for each step's compute (a pool learner's runs take turns on the one base)
        self.parallel = parallel
        self.policy = policy
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.checkpointer = checkpointer
        self.state = state
        self.session = session
        self.metrics = metrics
        self.ledger = ledger or Ledger(None)
        self.loss_config = LossConfig.from_learner(config.learner)
        self.learner_dir = config.run_dir / "learner"
        self.adapter_root = self.learner_dir / "adapters"
        self.timeline = timeline if timeline is not None else Timeline(None)  # rank 0's, marked since start-up
        self.tracker = tracking.open_tracker(config, is_main=parallel.is_main)  # run.report_to (rank 0)
        self.metrics_log = MetricsLog(self.learner_dir / "metrics.jsonl" if parallel.is_main else None,
                                      session=session.link.hello.session if session is not None else "",
                                      resumed_step=state.step, sinks=[self.tracker.log_step])
        self.timers = Timers()
        self.stop_requested = False
        self.stop_signal = ""  # which signal set stop_requested (logged by the loop, never by the handler)
        self.last_checkpoint_step = state.step
        self.checkpoint_s_unreported = 0.0  # checkpoint seconds since the last metrics line (in the next line)
        self.published_step = state.step  # the step whose parameters the newest version holds
        self.newest: publish.AdapterSnapshot | None = None
        self.written_version = 0
        self.integrity = integrity.IntegrityCheck(config, policy, parallel)  # collective (its seed)
        self.integrity.watch(optimizer)

    def start_history(self, loaded_version: int) -> None:
        """Collective: the versions the parameters hold at start-up, for the policy check: v0 (the zero-B LoRA) on
        a fresh start; after a resume the checkpoint's version, when its weights are that version's (a checkpoint
        taken at a step that published; with learner.publish_every > 1 it may not be), with the sha256 they publish
        as. The version they are republished as, if any, is recorded by :meth:`publish`."""
        if not self.integrity.enabled:
            return
        if self.state.step == 0:
            self.integrity.record(0, "")
        elif self.state.step % self.config.learner.publish_every == 0:
            snap = publish.snapshot(self.policy, version=loaded_version, step=self.state.step,
                                    is_main=self.parallel.is_main)
            self.integrity.record(loaded_version, snap.sha256 if snap is not None else None)

    # -- phases ----------------------------------------------------------------------------------------------

    def _mark(self, state: str) -> None:
        self.timeline.mark(state)
        if self.session is not None:
            self.session.link.set_state(state, adapter_version=self.state.version, steps=self.state.step,
                                        busy_s=round(self.timers.busy_s, 3), wait_s=round(self.timers.wait_s, 3),
                                        busy_share=round(self.timers.busy_share(), 4),
                                        integrity_trusted=self.integrity.trust.num_trusted(),
                                        integrity_audited_steps=int(self.metrics.total("integrity_audited_steps")))

    def _want_batch(self) -> None:
        if self.session is not None:
            self.session.want_batch(self.config.run.groups_per_step, self.config.learner.batch_wait_ms,
                                    self.state.version)

    def wait_for_batch(self) -> tuple[data.StepBatch, Received | None] | None:
        """The next step batch on every rank, or None when the loop must stop (collective)."""
        self._mark("waiting")
        self._want_batch()
        while True:
            received, frames = None, None
            if self.session is not None:
                item = self.session.poll(POLL_S)
                if item is not None:
                    received, frames = self._select(item.record, item.envelope)
            stop, ready = self.parallel.agree(self.stop_requested, frames is not None)
            if stop:
                log.info("stop_requested", signal=self.stop_signal or "(on another rank)")
                return None
            if ready:
                break
        step_batch = data.decode_step_batch(self.parallel.broadcast_frames(frames))
        return step_batch, received

    def _select(self, batch: Batch, envelope: Any) -> tuple[Received, list[Any]]:
        selection = data.select_groups(batch, envelope.specs, envelope.frames, version=self.state.version,
                                       max_staleness=self.config.run.max_staleness,
                                       trained_group_ids=self.state.trained_group_ids,
                                       vocab_size=self.policy.vocab_size, scale_by_std=self.config.learner.scale_by_std,
                                       withdrawn=self.state.withdrawn)
        for reason, count in selection.skipped.items():
            self.metrics.inc("groups_skipped", count, reason=reason)
        frames = data.trainable_frames(batch, envelope.specs, envelope.frames, selection.train)
        rewards = [r for entry in batch.groups for r in entry.group.rewards]
        return Received(batch=batch, selection=selection, rewards=rewards), frames

    def publish(self) -> float:
        """Gather the adapter and publish it as the next version (collective); returns the seconds spent."""
        started = time.monotonic()
        self._mark("publishing")
        latest = self.session.latest_version if self.session is not None else 0
        # never a number the broker already has; rank 0 alone knows the broker's, every rank needs the number
        version = self.parallel.broadcast_int(max(self.state.version, latest) + 1)
        snap = publish.snapshot(self.policy, version=version, step=self.state.step, is_main=self.parallel.is_main)
        self.published_step = self.state.step
        self.state.version = version
        self.integrity.record(version, snap.sha256 if snap is not None else None)
        if snap is not None:
            self.newest = snap
            assert self.session is not None
            self.ledger.publish(version=version, step=self.state.step, sha256=snap.sha256, num_bytes=snap.num_bytes)
            self.session.publish(snap)
            every = self.config.learner.save_adapter_every
            if every and version % every == 0:
                publish.write_adapter_dir(self.adapter_root, snap)
                self.written_version = version
        return time.monotonic() - started

    def checkpoint(self) -> float:
        started = time.monotonic()
        self._mark("publishing")
        self.checkpointer.save(self.policy, self.optimizer, self.scheduler, self.state)
        self.state.checkpoint_version = self.state.version
        self.last_checkpoint_step = self.state.step
        return time.monotonic() - started

    # -- the loop --------------------------------------------------------------------------------------------

    def run(self) -> int:
        num_steps = self.config.run.num_steps
        log.info("learner_started", step=self.state.step, version=self.state.version,
                 world_size=self.parallel.world_size, device=str(self.parallel.device))
        while not (num_steps and self.state.step >= num_steps):
            waited = time.monotonic()
            got = self.wait_for_batch()
            if got is None:
                break
            step_batch, received = got
            if self._replayed(received):
                continue
            num_masked = data.mask_stale_tokens(step_batch, self.state.version, self.config.run.max_staleness)
            wait_s = time.monotonic() - waited
            self._mark("training")
            computed = time.monotonic()
            trained_version = self.state.version
            with self.turn():
                stats, step_batch, verdict = checked_train_step(
                    self.policy, self.optimizer, self.scheduler, step_batch, check=self.integrity,
                    parallel=self.parallel, config=self.config, loss_config=self.loss_config)
            self.refuse(received, verdict)
            self.state.step += 1
            compute_s = time.monotonic() - computed - verdict.seconds
            publish_s = 0.0
            if self.state.step % self.config.learner.publish_every == 0:
                publish_s = self.publish()
            if not (num_steps and self.state.step >= num_steps):
                self._want_batch()  # the broker assembles the next batch while we checkpoint and report
            if received is not None:
                self.state.trained_group_ids.update(received.selection.ack_group_ids)
                self._record(received, trained_version)
            self.timers.busy_s += verdict.seconds + compute_s + publish_s
            self.timers.wait_s += wait_s
            if received is not None:  # the step's line before its checkpoint: a committed step always has one
                self._report(stats, received, step_batch, trained_version=trained_version, wait_s=wait_s,
                             compute_s=compute_s, publish_s=publish_s, checkpoint_s=self.checkpoint_s_unreported,
                             num_masked=num_masked)
                self.checkpoint_s_unreported = 0.0
            every = self.config.learner.checkpoint_every
            if every and self.state.step % every == 0:
                checkpoint_s = self.checkpoint()
                self.timers.busy_s += checkpoint_s
                self.checkpoint_s_unreported += checkpoint_s
            if received is not None:
                self._acknowledge(received, trained_version)
        self.finish()
        return 0

    def _replayed(self, received: Received | None) -> bool:
        """A batch of groups this learner trained already (a broker serving again what a killed learner's
        checkpoint holds): acknowledged without a step, so a crash never spends a step of ``run.num_steps`` on
        nothing (collective: rank 0 decides)."""
        skipped = received.selection.skipped_ids if received is not None else {}
        replay = received is not None and not received.selection.train and set(skipped) == {"already_trained"}
        if not self.parallel.broadcast_int(int(replay)):
            return False
        if received is not None:
            self.metrics.inc("batches_replayed")
            log.info("batch_replayed", batch_id=received.batch.batch_id, groups=len(skipped["already_trained"]))
            self._acknowledge(received, self.state.version)
        self._want_batch()
        return True

    def refuse(self, received: Received | None, verdict: verdicts.Verdict) -> None:
        """Rank 0: the groups the policy check failed (loraflow.learner.integrity) skipped as policy_mismatch, counted,
        logged, left out of the BatchAck (their prompts are re-queued) and reported in its mismatches."""
        if received is None:
            return
        received.verdict = verdict
        if not verdict.mismatches:
            return
        failed = sorted(set(range(len(received.selection.train))) - set(verdict.keep))
        data.refuse_groups(received.selection, received.batch, failed, version=self.state.version)
        self.metrics.inc("groups_skipped", len(failed), reason="policy_mismatch")
        verdicts.log_mismatches(verdict)

    def _record(self, received: Received, trained_version: int) -> None:
        """The step's ledger line (before its checkpoint and BatchAck, see loraflow.learner.ledger)."""
        selection, groups = received.selection, received.batch.groups
        trained = [groups[i].group.group_id for i in selection.train]
        zero_variance = selection.skipped_ids.get("zero_variance", [])
        self.ledger.step(step=self.state.step, batch_id=received.batch.batch_id, trained_version=trained_version,
                         trained=trained, zero_variance=zero_variance,
                         already_trained=selection.skipped_ids.get("already_trained", []),
                         not_acked=[g for r in ("stale", "invalid", "withdrawn", "policy_mismatch")
                                    for g in selection.skipped_ids.get(r, [])],
                         versions=selection.token_versions,
                         workers={groups[i].group.group_id: groups[i].group.worker_id for i in selection.train})

    def _acknowledge(self, received: Received, trained_version: int) -> None:
        assert self.session is not None
        self.session.ack_batch(BatchAck(batch_id=received.batch.batch_id, step=self.state.step,
                                        trained_version=trained_version,
                                        group_ids=received.selection.ack_group_ids,
                                        checkpoint_version=self.state.checkpoint_version,
                                        mismatches=received.verdict.mismatches if received.verdict else []))

    def _report(self, stats: dict[str, Any], received: Received, step_batch: data.StepBatch, *, trained_version: int,
                wait_s: float, compute_s: float, publish_s: float, checkpoint_s: float, num_masked: int) -> None:
        self.metrics.inc("steps")
        self.metrics.inc("tokens_trained", stats["num_tokens"])
        self.metrics.inc("tokens_masked_stale", num_masked)
        self.metrics.set("version", self.state.version)
        self.metrics.set("busy_share", self.timers.busy_share())
        self.metrics.set("integrity_trusted_workers", self.integrity.trust.num_trusted())
        if received.verdict is not None and received.verdict.audited:
            self.metrics.inc("integrity_audited_steps")
        rewards = torch.tensor(received.rewards, dtype=torch.float64)
        adapter_acks = self.session.adapter_acks if self.session is not None else []
        line = {
            "step": self.state.step,
            "version": self.state.version,
            "time_unix": round(time.time(), 3),
            "elapsed_s": round(time.monotonic() - self.timers.start, 3),
            "batch_id": received.batch.batch_id,
            "num_groups": len(received.batch.groups),
            "num_groups_trained": step_batch.num_groups,
            "reward_mean": float(rewards.mean()) if rewards.numel() else 0.0,
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "reward_components": reward_means_of([entry.group for entry in received.batch.groups]),
            **stats,
            "staleness": {str(k): v for k, v in sorted(received.selection.staleness.items())},
            "staleness_zero_variance": _zero_variance_staleness(received, trained_version),
            "tokens_masked_stale": num_masked,
            "skipped": dict(received.selection.skipped),
            "wait_s": round(wait_s, 6),
            "integrity_s": round(received.verdict.seconds, 6) if received.verdict else 0.0,
            "integrity_tokens": received.verdict.num_checked_tokens if received.verdict else 0,
            "integrity_unverifiable_tokens": received.verdict.num_unverifiable_tokens if received.verdict else 0,
            "integrity_max_passing_diff": received.verdict.max_passing_diff if received.verdict else 0.0,
            "integrity_free_tokens": received.verdict.num_free_tokens if received.verdict else 0,
            "integrity_free_s": round(received.verdict.free_seconds, 6) if received.verdict else 0.0,
            "integrity_forwards": received.verdict.num_forwards if received.verdict else 0,
            "integrity_redone": int(received.verdict.redone) if received.verdict else 0,
            "integrity_audited": int(received.verdict.audited) if received.verdict else 0,
            "integrity_unaudited_tokens": received.verdict.num_unaudited_tokens if received.verdict else 0,
            "integrity_trusted_workers": self.integrity.trust.num_trusted(),
            "compute_s": round(compute_s, 6),
            "publish_s": round(publish_s, 6),
            "checkpoint_s": round(checkpoint_s, 6),  # the checkpoint taken after the previous line
            "tokens_per_s": stats["num_tokens"] / compute_s if compute_s > 0 else 0.0,
            "busy_share": round(self.timers.busy_share(), 4),
            "adapter_ack_s": {str(a.version): round(a.seconds, 6) for a in adapter_acks},
        }
        adapter_acks.clear()
        self.metrics_log.emit(line)
        log.info("step", step=self.state.step, version=self.state.version, loss=round(line["loss"], 5),
                 reward=round(line["reward_mean"], 4), tokens=stats["num_tokens"], wait_s=round(wait_s, 3),
                 compute_s=round(compute_s, 3), publish_s=round(publish_s, 3), integrity_s=round(line["integrity_s"], 3))

    def finish(self) -> None:
        """Clean stop: publish what is unpublished, write the final adapter dir and checkpoint (collective)."""
        self._mark("stopping")
        if self.state.step > self.published_step:
            self.publish()
        if self.config.learner.checkpoint_every and self.state.step > self.last_checkpoint_step:
            self.checkpoint()
        if self.parallel.is_main and self.newest is not None and self.written_version != self.newest.version:
            publish.write_adapter_dir(self.adapter_root, self.newest)
        if self.session is not None and not self.session.drain(DRAIN_TIMEOUT_S):
            log.warning("unacknowledged_at_exit", pending=self.session.num_unacked)
        self.tracker.close()
        log.info("learner_stopped", step=self.state.step, version=self.state.version)
        self.timeline.close()  # the final mark: a clean stop


def _zero_variance_staleness(received: Received, trained_version: int) -> dict[str, int]:
    """Staleness -> groups acknowledged without a gradient (all rewards equal): trained groups that
    ``staleness`` (groups with a gradient) leaves out."""
    ids = set(received.selection.skipped_ids.get("zero_variance", []))
    counts: collections.Counter[int] = collections.Counter()
    for entry in received.batch.groups:
        if entry.group.group_id in ids:
            ids.discard(entry.group.group_id)  # a group id twice in a batch: the first copy was the one judged
            counts[versions.staleness(trained_version, entry.group.max_version)] += 1
    return {str(k): v for k, v in sorted(counts.items())}
