"""The single-process reference of the demo: the same GRPO loop in one process, with loraflow's own parts, no broker.

What ``loraflow run`` spreads over a broker, two workers and a learner, done one after the other in one process
with the very code the roles run (imported, not copied)::

    generate  PromptLeases of the task's train split, in order (as broker/leasing.py builds them), one step's
              groups in hand at a time: loraflow.rollout_worker.rollout.Rollouts over the worker's backend
              (loraflow.rollout_worker.backends.make_backend: hf, seeded as a worker is), environments and rewards of
              the worker (worker.env, worker.reward)
    select    the finished groups as a Batch message (loraflow.common.protocol), then the learner's rank-0 selection
              (loraflow.learner.data.select_groups: zero-variance groups acknowledged, not trained) and decode
              (trainable_frames, decode_step_batch)
    train     loraflow.learner.step.train_step on the learner's Policy (loraflow.learner.model.build_policy, a job of one) with
              its optimizer and LR schedule (make_optimizer) and loss (LossConfig.from_learner)
    publish   loraflow.learner.publish.snapshot -> AdapterUpdate frames -> the worker's AdapterStore.receive (sha256
              checked, PEFT directory) -> backend.add_adapter + retain: the hot-swap path of a worker; every
              ``adapter_every`` versions loraflow.learner.publish.write_adapter_dir, for the held-out evaluation

Every step is on-policy (staleness 0: each step's samples come from the version the step trains). The step's
``run.groups_per_step`` groups are generated together, the groups the fleet has in flight
(``launch.num_workers`` x ``worker.capacity`` = 16 in the demo). What the single process leaves out is what only a
distributed run needs: sockets, leases and acks, the policy check of untrusted workers (loraflow.learner.integrity),
checkpoints, the launcher's supervision. One torch thread pool of ``num_threads`` (default: every core) serves
generation and training in turn.

Run as a script it writes one JSON object (start-up seconds, per-step times and statistics, the adapter
directories) for bench/time_to_accuracy.py::

    .venv/bin/python -m bench.single_process --config RUN_DIR/config.toml --steps 60 --out DIR [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: seconds the loop waits for an environment step between polls (the worker loop's wake event, set when one ends)
ENV_WAIT_S = 0.05


@dataclass(slots=True, kw_only=True)
class RefStep:
    """One step of the reference loop; times are unix seconds / seconds."""

    step: int
    version: int             # the version the step's parameters publish as
    time_unix: float         # the step's adapter exists (published to the backend, written if due)
    num_samples: int         # generated this step (groups x group_size)
    num_groups_trained: int  # after the selection (zero-variance groups skipped)
    loss: float
    reward_mean: float
    generate_s: float
    train_s: float
    publish_s: float


@dataclass(slots=True, kw_only=True)
class RefRun:
    startup_s: float         # process start (or the call) to the first generate: models built, imports done
    started_unix: float      # the first generate begins: the training clock's zero
    steps: list[RefStep] = field(default_factory=list)
    adapters: dict[int, str] = field(default_factory=dict)  # version -> PEFT directory written


class SingleProcess:
    """The demo's GRPO loop in one process (see the module docstring); :meth:`step` runs one iteration."""

    def __init__(self, config: Any, *, adapter_root: Path, adapter_every: int = 1, num_threads: int = 0) -> None:
        import torch

        from loraflow.common.tasks import load_task
        from loraflow.common.tiny_model import resolve_model
        from loraflow.learner.loss import LossConfig
        from loraflow.learner.model import build_policy
        from loraflow.learner.parallel import init_parallel
        from loraflow.learner.step import make_optimizer
        from loraflow.rollout_worker.adapters import AdapterStore
        from loraflow.rollout_worker.backends import make_backend
        from loraflow.rollout_worker.envs import EnvResolver
        from loraflow.rollout_worker.rewards import load_rewards
        from loraflow.rollout_worker.rollout import Rollouts

        self.config = config
        self.adapter_root = adapter_root
        self.adapter_every = adapter_every
        self.task = load_task(config.run.task, config.run.seed, config.data)
        self.backend = make_backend(config, worker_id="reference", max_staleness=0)
        torch.set_num_threads(num_threads or os.cpu_count() or 1)  # after make_backend, which sets the worker's
        self.parallel = init_parallel(config.learner.device)
        torch.manual_seed(config.run.seed + self.parallel.rank)  # as loraflow.learner.start.run seeds before the build
        model_dir = resolve_model(config.model.path, config.model.cache_dir)
        self.policy = build_policy(Path(model_dir), config.learner, self.parallel, seed=config.run.seed,
                                   max_message_bytes=config.broker.max_message_bytes)
        self.optimizer, self.scheduler = make_optimizer(self.policy, config.learner)
        self.loss_config = LossConfig.from_learner(config.learner)
        self.store = AdapterStore(adapter_root / "received")
        self.wake = threading.Event()
        self.rollouts = Rollouts(self.backend, EnvResolver(config.worker.env), config.worker, worker_id="reference",
                                 max_seq_len=config.model.max_seq_len, rewards=load_rewards(config.worker),
                                 wake=self.wake)
        self.version = 0
        self.num_steps = 0
        self.cursor = 0  # the next train-split prompt index
        self.trained_group_ids: set[str] = set()
        self.adapters: dict[int, str] = {}

    # -- one iteration -----------------------------------------------------------------------------------------

    def _lease(self) -> Any:
        from loraflow.common.protocol import PromptLease

        index, self.cursor = self.cursor, self.cursor + 1
        group_id = f"0:{index}"
        return PromptLease(lease_id=f"ref-{index}", group_id=group_id, prompt_index=index, epoch=0,
                           task=self.config.run.task, group_size=self.config.run.group_size,
                           deadline_s=self.config.broker.lease_timeout_s,
                           **self.task.item(index, "train").lease_fields())

    def generate(self) -> list[Any]:
        """One step's groups, generated together under the current version: FinishedGroups."""
        for _ in range(self.config.run.groups_per_step):
            self.rollouts.add(self._lease())
        finished: list[Any] = []
        while self.rollouts.num_groups:
            self.wake.clear()
            if self.rollouts.has_ready():
                finished += self.rollouts.step()
                continue
            done = self.rollouts.poll()
            finished += done
            if not done:
                self.wake.wait(ENV_WAIT_S)  # environment steps run in guarded threads, which set it when done
        return finished

    def select(self, finished: list[Any]) -> tuple[Any, Any]:
        """(StepBatch, Selection): the groups through a Batch message and the learner's rank-0 selection."""
        from bench.harness import codec
        from loraflow.common import protocol
        from loraflow.learner import data

        entries = [protocol.BatchEntry(group=f.group, first_tensor=i * data.NUM_GROUP_TENSORS)
                   for i, f in enumerate(finished)]
        batch_id = f"ref-{self.num_steps}"
        frames = codec.encode(protocol.Batch(batch_id=batch_id, groups=entries, latest_version=self.version),
                                 [t for f in finished for t in f.tensors])
        batch, envelope = codec.decode(frames)
        selection = data.select_groups(batch, envelope.specs, envelope.frames, version=self.version,
                                       max_staleness=0, trained_group_ids=self.trained_group_ids,
                                       vocab_size=self.policy.vocab_size,
                                       scale_by_std=self.config.learner.scale_by_std)
        step_batch = data.decode_step_batch(data.trainable_frames(batch, envelope.specs, envelope.frames,
                                                                  selection.train))
        self.trained_group_ids.update(selection.ack_group_ids)
        return step_batch, selection

    def train(self, step_batch: Any) -> dict[str, Any]:
        from loraflow.learner.step import train_step

        stats = train_step(self.policy, self.optimizer, self.scheduler, step_batch, parallel=self.parallel,
                           config=self.config, loss_config=self.loss_config)
        self.num_steps += 1
        return stats

    def publish(self) -> None:
        """The next version into the backend as a worker receives it; its PEFT directory when due."""
        from bench.harness import codec
        from loraflow.learner import publish

        if self.num_steps % self.config.learner.publish_every:
            return
        self.version += 1
        snap = publish.snapshot(self.policy, version=self.version, step=self.num_steps, is_main=True)
        assert snap is not None
        update, envelope = codec.decode(codec.encode(snap.update(), snap.tensors))
        adapter = self.store.receive(update, envelope.specs, envelope.frames)
        self.backend.add_adapter(adapter)
        self.backend.retain({self.version})
        self.store.prune({self.version}, upto_version=self.version)
        if self.adapter_every and self.version % self.adapter_every == 0:
            self.adapters[self.version] = str(publish.write_adapter_dir(self.adapter_root, snap))

    def step(self) -> RefStep:
        started = time.monotonic()
        finished = self.generate()
        generated = time.monotonic()
        step_batch, _ = self.select(finished)
        stats = self.train(step_batch)
        trained = time.monotonic()
        self.publish()
        rewards = [r for f in finished for r in f.group.rewards]
        return RefStep(step=self.num_steps, version=self.version, time_unix=time.time(),
                       num_samples=len(rewards), num_groups_trained=step_batch.num_groups, loss=stats["loss"],
                       reward_mean=sum(rewards) / max(len(rewards), 1), generate_s=generated - started,
                       train_s=trained - generated, publish_s=time.monotonic() - trained)

    def close(self) -> None:
        self.backend.close()
        self.parallel.close()


def run_reference(config: Any, *, num_steps: int, adapter_root: Path, adapter_every: int = 1, num_threads: int = 0,
                  started_s: float | None = None) -> RefRun:
    """Build the loop and run ``num_steps`` steps; the start-up counts from ``started_s`` (monotonic; default
    now). The last step's adapter is always written."""
    started_s = time.monotonic() if started_s is None else started_s
    loop = SingleProcess(config, adapter_root=adapter_root, adapter_every=adapter_every, num_threads=num_threads)
    try:
        run = RefRun(startup_s=time.monotonic() - started_s, started_unix=time.time())
        for _ in range(num_steps):
            run.steps.append(loop.step())
        if loop.version and loop.version not in loop.adapters:
            from loraflow.learner import publish

            snap = publish.snapshot(loop.policy, version=loop.version, step=loop.num_steps, is_main=True)
            assert snap is not None
            loop.adapters[loop.version] = str(publish.write_adapter_dir(adapter_root, snap))
        run.adapters = dict(loop.adapters)
        return run
    finally:
        loop.close()


def main() -> None:
    started_s = time.monotonic() - process_age_s()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a resolved config.toml (a loraflow run's)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True, help="directory: adapters and result.json")
    parser.add_argument("--adapter-every", type=int, default=1, help="write a PEFT directory every N versions")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = every core)")
    args = parser.parse_args()
    from loraflow.common.config import load_config

    out = Path(args.out)
    run = run_reference(load_config(args.config), num_steps=args.steps, adapter_root=out / "adapters",
                        adapter_every=args.adapter_every, num_threads=args.threads, started_s=started_s)
    (out / "result.json").write_text(json.dumps(asdict(run)))


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc), so the start-up includes the interpreter's imports."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime_s - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


if __name__ == "__main__":
    main()
