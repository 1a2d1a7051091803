"""A whole loraflow system as real processes on one run directory, each role killable and restartable.

:class:`System` starts ``python -m loraflow.broker``, N ``python -m loraflow.rollout_worker`` and ``python -m loraflow.learner`` (under
``torchrun`` for several ranks) from one TOML file, the way an operator would, with fast heartbeats and JSON
logs (the workers' logs are part of the ledger). The broker binds an ephemeral port once; a restarted broker
binds the same endpoint, so clients reconnect to it as they would to a supervised broker on a fixed port.

``kill(role)`` is SIGKILL: nothing of the process's state survives but what it wrote to disk. ``restart`` starts
a new incarnation (a new log file, a new session; a worker keeps its id). Under torchrun, killing one rank makes
the elastic agent stop the others and exit; :meth:`System.kill_learner_rank` waits for that before restarting.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraflow.common.cli import one_host_torchrun
from loraflow.common.transport import BrokerUnavailable, fetch_stats
from loraflow.deploy.processes import descendants, signal_tree
from loraflow.learner.ledger import read as read_ledger
from tests.support import Proc, Processes, wait_for

HEARTBEAT_S = 0.2


def write_config(path: Path, *, run_dir: Path, model_dir: Path, backend: str, num_prompts: int,
                 groups_per_step: int = 4, group_size: int = 4, checkpoint_every: int = 2, max_staleness: int = 2,
                 seed: int = 0, extra: str = "") -> Path:
    """One TOML for every role of a small single-epoch run (``extra``: more TOML appended, e.g. [security])."""
    path.write_text(f"""
[run]
run_dir = "{run_dir}"
seed = {seed}
group_size = {group_size}
groups_per_step = {groups_per_step}
max_staleness = {max_staleness}
log_format = "json"
[model]
path = "{model_dir}"
[broker]
prompt_limit = {num_prompts}
num_epochs = 1
heartbeat_interval_s = {HEARTBEAT_S}
heartbeat_misses = 5
lease_timeout_s = 20
[worker]
backend = "{backend}"
capacity = 2
num_threads = 1
reward = "tests.fault.rewards:coin"
max_new_tokens = 8
chunk_tokens = 4
[worker.sim]
tokens_per_s = 200
mean_tokens = 6
[learner]
lora_rank = 4
checkpoint_every = {checkpoint_every}
keep_checkpoints = 2
save_adapter_every = 0
num_threads = 1
batch_wait_ms = 200
micro_batch_tokens = 512
[integrity]
check = {"false" if backend == "sim" else "true"}
{extra}""")
    return path


@dataclass
class System:
    procs: Processes
    config: Path
    run_dir: Path
    num_workers: int = 2
    learner_ranks: int = 1
    endpoint: str = ""
    broker: Proc | None = None
    learner: Proc | None = None
    workers: dict[int, Proc] = field(default_factory=dict)
    incarnations: Counter = field(default_factory=Counter)
    kills: list[str] = field(default_factory=list)

    # -- starting ----------------------------------------------------------------------------------------------

    def _name(self, role: str) -> str:
        self.incarnations[role] += 1
        return f"{role}.{self.incarnations[role]}"

    def start(self) -> None:
        self.start_broker()
        for i in range(1, self.num_workers + 1):
            self.start_worker(i)
        self.start_learner()

    def start_broker(self) -> None:
        endpoint_file = self.run_dir / "broker.endpoint"
        endpoint_file.unlink(missing_ok=True)
        bind = self.endpoint or "tcp://127.0.0.1:0"
        self.broker = self.procs.python(self._name("broker"), "loraflow.broker", str(self.config), "--set", f'broker.bind="{bind}"',
                                        "--set", f'broker.endpoint_file="{endpoint_file}"')
        wait_for(lambda: endpoint_file.is_file() and endpoint_file.read_text().strip() or not self.broker.alive(), 30,
                 "the broker to bind", self.procs)
        assert self.broker.alive(), self.broker.log()
        self.endpoint = endpoint_file.read_text().strip()

    def start_worker(self, index: int) -> None:
        self.workers[index] = self.procs.python(self._name(f"worker-{index}"), "loraflow.rollout_worker", str(self.config),
                                                "--endpoint", self.endpoint, "--worker-id", f"w{index}")

    def start_learner(self) -> None:
        args = [str(self.config), "--endpoint", self.endpoint]
        if self.learner_ranks == 1:
            self.learner = self.procs.python(self._name("learner"), "loraflow.learner", *args)
        else:
            self.learner = self.procs.spawn(self._name("learner"), [
                sys.executable, *one_host_torchrun(self.learner_ranks), "-m", "loraflow.learner", *args])

    # -- killing -----------------------------------------------------------------------------------------------

    def kill(self, role: str) -> None:
        """SIGKILL one process of ``role`` (broker, learner, worker-<i>) and start it again."""
        if role == "learner" and self.learner_ranks > 1:
            self.kill_learner_rank(0)
            return
        self.kills.append(role)
        if role == "broker":
            self.broker.kill()
            self.start_broker()
        elif role == "learner":
            self.learner.kill()
            self.start_learner()
        else:
            index = int(role.rsplit("-", 1)[1])
            self.workers[index].kill()
            self.start_worker(index)

    def kill_learner_rank(self, rank: int) -> None:
        """SIGKILL one rank of the torchrun job; the agent stops the others and exits; start a new job."""
        self.kills.append(f"learner-rank-{rank}")
        pid = wait_for(lambda: self._rank_pid(rank), 60, f"learner rank {rank} to run", self.procs)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not self.learner.alive(), 60, "torchrun to stop after a rank died", self.procs)
        self._reap_learner()
        self.start_learner()

    def _rank_pid(self, rank: int) -> int | None:
        for child in descendants(self.learner.pid):
            with contextlib.suppress(OSError):
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                if f"RANK={rank}".encode() in environ:
                    return child
        return None

    def _reap_learner(self) -> None:
        """No rank of a dead learner job may linger (it would hold the old session's place)."""
        signal_tree(self.learner.pid, signal.SIGKILL)  # the ranks: sessions of their own
        self.learner.popen.wait(timeout=10)

    def kill_after_uncommitted_step(self, checkpoint_every: int, tries: int = 3) -> None:
        """Kill the learner right after a step no checkpoint covers (so a rollback must happen); retried if the
        kill landed after a checkpoint after all."""
        for _ in range(tries):
            wait_for(lambda: self._last_step() % checkpoint_every == 1, 90, "a step after a checkpoint", self.procs,
                     interval_s=0.01)
            if self.learner_ranks > 1:
                self.kill_learner_rank(0)
            else:
                self.kill("learner")
            if self._last_step() % checkpoint_every != 0:
                return
        raise AssertionError(f"{tries} kills all landed right after a checkpoint")

    def run_schedule(self, schedule: list[str], rng: Any, *, steps_between: int, checkpoint_every: int) -> None:
        """Kill the roles in ``schedule`` in turn, each after ``steps_between`` more learner steps and a random
        delay; ``learner+`` kills the learner right after an uncheckpointed step, ``learner-rank-<r>`` one rank."""
        for role in schedule:
            target = self.ledger_steps() + steps_between
            wait_for(lambda target=target, role=role: self._progressed(target, role), 120,
                     f"{steps_between} more steps before killing {role}", self.procs, interval_s=0.05)
            time.sleep(rng.uniform(0, 0.5))
            if role == "learner+":
                self.kill_after_uncommitted_step(checkpoint_every)
            elif role.startswith("learner-rank-"):
                self.kill_learner_rank(int(role.rsplit("-", 1)[1]))
            else:
                self.kill(role)

    # -- observing ---------------------------------------------------------------------------------------------

    def _progressed(self, target_steps: int, role: str) -> bool:
        if self.ledger_steps() >= target_steps:
            return True
        stats = self.stats()
        if stats is not None and stats["prompts"]["exhausted"] and stats["prompts"]["queued"] == 0 \
                and stats["prompts"]["leased"] + stats["prompts"]["buffered"] + stats["prompts"]["training"] == 0:
            raise AssertionError(f"the run trained every prompt before the schedule killed {role}: give it more "
                                 f"prompts (kills so far: {self.kills})")
        return False

    def _last_step(self) -> int:
        path = self.run_dir / "learner" / "ledger.jsonl"
        steps = [line["step"] for line in read_ledger(path) if line["event"] == "step"]
        return steps[-1] if steps else 0

    def stats(self) -> dict[str, Any] | None:
        try:
            return fetch_stats(self.endpoint, timeout_s=2.0)
        except BrokerUnavailable:
            return None

    def trained(self) -> int:
        stats = self.stats()
        return stats["prompts"]["trained_total"] if stats else -1

    def ledger_steps(self) -> int:
        path = self.run_dir / "learner" / "ledger.jsonl"
        return path.read_text().count('"event":"step"') if path.is_file() else 0

    def wait_all_trained(self, num_prompts: int, timeout_s: float) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            stats = self.stats()
            if stats is None:
                return None
            p = stats["prompts"]
            finished = (p["trained_total"] == num_prompts and p["exhausted"]
                        and p["queued"] + p["leased"] + p["buffered"] + p["training"] == 0)
            return stats if finished else None

        return wait_for(done, timeout_s, f"all {num_prompts} prompts trained", self.procs, interval_s=0.2)

    def stop(self) -> None:
        """Clean stop, learner first (its final checkpoint needs the broker), then workers, then the broker.
        Under torchrun every rank gets the SIGTERM (the agent would turn its own into a failure)."""
        if self.learner_ranks > 1:
            for rank in range(self.learner_ranks):
                os.kill(self._rank_pid(rank), signal.SIGTERM)
            wait_for(lambda: not self.learner.alive(), 60, "the learner ranks to stop", self.procs)
            assert self.learner.popen.returncode == 0, self.learner.log()[-3000:]
        procs = [*self.workers.values(), self.broker]
        for proc in ([self.learner] if self.learner_ranks == 1 else []) + procs:
            code = proc.stop(timeout_s=60)
            assert code == 0, f"{proc.name} exited with {code}\n{proc.log()[-3000:]}"
