"""A real run with one healthy worker and one faulty client, and the audit of what the policy check did.

The run: a broker and a learner (CURVE on, keys from ``loraflow keys``), healthy hf worker ``good``, and one
or more faulty clients (``bad`` unless named otherwise): a real worker with an engine fault
(:mod:`tests.integrity.faulty_worker`) or the raw cheating client (:mod:`tests.integrity.raw_client`). The audit
(:func:`audit`) reads the learner's ledger (which worker each trained group came from), its ``policy_mismatch``
lines and the broker's stats, and answers what issue 14 asks: was each fault detected, within how many learner
steps of the first affected group reaching the learner, how many affected groups were trained (must be 0), is
each faulty client quarantined, did the run go on with ``good``.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraflow.common.security import ClientSecurity
from loraflow.common.transport import BrokerUnavailable, fetch_stats
from loraflow.learner.ledger import read as read_ledger
from tests.fault.ledger import committed_chain, read_json_lines
from tests.fault.system import System, write_config
from tests.integrity.faulty_worker import TURN_ENV
from tests.integrity.gate import ENV as GATE_ENV
from tests.support import REPO, Proc, Processes, child_env, wait_for

BAD = "bad"
GOOD = "good"


def make_keys(directory: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "loraflow.deploy.cli", "keys", str(directory)], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return directory


@dataclass
class IntegrityRun(System):
    """:class:`tests.fault.system.System` with CURVE on, worker ``good`` and the faulty clients in :attr:`bad`."""

    keys: Path = Path()
    bad: dict[str, Proc] = field(default_factory=dict)  # worker id -> its process
    observer: Any = None

    def stats(self) -> dict[str, Any] | None:
        if self.observer is None:
            self.observer = ClientSecurity.load(self.keys, "observer", role="observer")
        try:
            return fetch_stats(self.endpoint, timeout_s=2.0, security=self.observer)
        except BrokerUnavailable:
            return None

    def start_worker(self, index: int, *, backend: str = "hf") -> None:
        self.workers[index] = self.procs.python(self._name(GOOD), "loraflow.rollout_worker", str(self.config),
                                                "--endpoint", self.endpoint, "--worker-id", GOOD,
                                                "--backend", backend)

    def start_bad(self, fault: str, model_dir: Path, *, worker_id: str = BAD, backend: str = "hf",
                  after_version: int = 0, gate: Path | None = None, turn: Path | None = None) -> Proc:
        """Start a faulty client; with ``gate`` it does its imports, then waits until that file exists
        (:mod:`tests.integrity.gate`); with ``turn`` it is healthy until that file exists (temperature)."""
        gated = {GATE_ENV: str(gate)} if gate is not None else {}
        if turn is not None:
            gated[TURN_ENV] = str(turn)
        if fault == "fabricated":
            report = self.run_dir / f"raw_client-{worker_id}.json"
            proc = self.procs.python(self._name(worker_id), "tests.integrity.raw_client", self.endpoint,
                                     str(model_dir), str(self.keys), worker_id, str(report), env=child_env(**gated))
        else:
            env = child_env(LORAFLOW_FAULT_AFTER_VERSION=str(after_version), **gated)
            proc = self.procs.python(self._name(worker_id), "tests.integrity.faulty_worker", fault, str(self.config),
                                     "--endpoint", self.endpoint, "--worker-id", worker_id, "--backend", backend,
                                     env=env)
        self.bad[worker_id] = proc
        return proc


def start_run(procs: Processes, tmp_path: Path, model_dir: Path, *, num_prompts: int, backend: str = "hf",
              extra: str = "", integrity: str = "") -> IntegrityRun:
    """``integrity``: more lines of the config's [integrity] table (e.g. ``audit_fraction = 0.25``)."""
    keys = make_keys(tmp_path / "keys")
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", run_dir=run_dir, model_dir=model_dir, backend=backend,
                          num_prompts=num_prompts, max_staleness=1, checkpoint_every=0,
                          extra=f'{integrity}\n[security]\nenabled = true\nkeys_dir = "{keys}"\n{extra}')
    run = IntegrityRun(procs=procs, config=config, run_dir=run_dir, num_workers=1, keys=keys)
    run.start_broker()
    run.start_learner()
    run.start_worker(1, backend=backend)
    return run


def quarantined(stats: dict[str, Any] | None) -> dict[str, Any]:
    """worker id -> its quarantine record in the broker's stats (empty when none)."""
    if not stats:
        return {}
    return {entry["worker"]: entry for entry in stats.get("integrity", {}).get("quarantined", [])}


@dataclass
class Audit:
    trained_from: dict[str, int] = field(default_factory=dict)  # worker id -> groups trained (the ledger's)
    mismatches: list[dict[str, Any]] = field(default_factory=list)  # the learner's policy_mismatch lines
    first_mismatch_step: int | None = None
    first_bad_step: int | None = None  # the first step whose batch held a group of a faulty client
    steps: int = 0
    checked_tokens: int = 0
    integrity_s: float = 0.0  # the check, summed over steps
    compute_s: float = 0.0    # forward + backward + optimizer, summed
    busy_s: float = 0.0       # check + compute + publish + checkpoint, summed
    wall_s: float = 0.0       # first to last step line
    max_passing_diff: float = 0.0  # the largest log-prob difference of a sample that passed (engine agreement)
    free_tokens: int = 0      # checked tokens whose log-probs came from the training forward
    free_s: float = 0.0       # the check's seconds spent on those (comparison, redo)
    forwards: int = 0         # re-scoring forwards (older versions), summed over steps
    redone_steps: int = 0     # steps redone without a group the training forward failed
    audited_steps: int = 0    # steps drawn for an audit (every worker's older versions re-scored)
    unaudited_tokens: int = 0  # chosen samples' older-version tokens of trusted workers not re-scored

    @property
    def steps_to_detect(self) -> int | None:
        """Learner steps from the first bad group reaching the learner to the first mismatch, both counted."""
        if self.first_mismatch_step is None or self.first_bad_step is None:
            return None
        return self.first_mismatch_step - self.first_bad_step + 1

    def summary(self) -> str:
        return (f"{self.steps} steps; trained from {self.trained_from}; {len(self.mismatches)} mismatches "
                f"(first at step {self.first_mismatch_step}, bad groups first at step {self.first_bad_step}); "
                f"largest difference of a passing sample {self.max_passing_diff:.2e} nats; "
                f"check {self.integrity_s:.3f} s, compute {self.compute_s:.3f} s, {self.wall_s:.1f} s of steps")


def audit(run_dir: Path, learner_log: Path, bad_ids: frozenset[str] = frozenset({BAD})) -> Audit:
    """What the learner did about the faulty clients ``bad_ids``, from its ledger, metrics and log (JSON lines)."""
    out = Audit()
    ledger = run_dir / "learner" / "ledger.jsonl"
    chain, _ = committed_chain(read_ledger(ledger)) if ledger.is_file() else ([], 0)
    out.steps = len(chain)
    for step in chain:
        for worker in step.get("workers", {}).values():
            out.trained_from[worker] = out.trained_from.get(worker, 0) + 1
            if worker in bad_ids and out.first_bad_step is None:
                out.first_bad_step = step["step"]
    metrics = run_dir / "learner" / "metrics.jsonl"
    lines = read_json_lines(metrics) if metrics.is_file() else []
    for line in lines:
        out.checked_tokens += int(line.get("integrity_tokens", 0))
        out.integrity_s += float(line.get("integrity_s", 0.0))
        out.compute_s += float(line.get("compute_s", 0.0))
        out.max_passing_diff = max(out.max_passing_diff, float(line.get("integrity_max_passing_diff", 0.0)))
        out.free_tokens += int(line.get("integrity_free_tokens", 0))
        out.free_s += float(line.get("integrity_free_s", 0.0))
        out.forwards += int(line.get("integrity_forwards", 0))
        out.redone_steps += int(line.get("integrity_redone", 0))
        out.audited_steps += int(line.get("integrity_audited", 0))
        out.unaudited_tokens += int(line.get("integrity_unaudited_tokens", 0))
        out.busy_s += sum(float(line.get(k, 0.0)) for k in ("integrity_s", "compute_s", "publish_s", "checkpoint_s"))
        if line.get("skipped", {}).get("policy_mismatch") and out.first_mismatch_step is None:
            out.first_mismatch_step = line["step"]
    if lines:
        out.wall_s = float(lines[-1]["elapsed_s"]) - float(lines[0]["elapsed_s"])
    if out.first_mismatch_step is not None:
        out.first_bad_step = min(out.first_bad_step or out.first_mismatch_step, out.first_mismatch_step)
    out.mismatches = [line for line in read_json_lines(learner_log) if line.get("event") == "policy_mismatch"]
    return out


@dataclass(frozen=True)
class LateFault:
    """How a worker that went wrong after its probation was caught (:func:`run_late_fault`)."""

    turned_at: int          # the first version it served wrong
    healthy_trained: int    # its groups trained from versions before that
    wrong_trained: int      # its groups trained from that version on (the probation rule's price)
    steps_to_detect: int    # learner steps from its first wrong group reaching the learner to the first mismatch
    seconds_to_quarantine: float  # from the fault's start (the turn) to the broker's quarantine


def trusted_process(learner_log: Path, worker_id: str) -> bool:
    """Whether the learner logged that a process of ``worker_id`` passed its probation."""
    return any(line.get("event") == "integrity_trusted" and str(line.get("worker", "")).startswith(f"{worker_id}#")
               for line in read_json_lines(learner_log))


def run_late_fault(run: IntegrityRun, model_dir: Path, worker_id: str, *, after_steps: int) -> LateFault:
    """Start a ``temperature`` worker that is healthy until the learner trusts it, then turn it; wait for its
    quarantine and ``after_steps`` more learner steps; stop it; what the ledger and logs say."""
    turn = run.run_dir.parent / f"turn-{worker_id}"
    run.start_bad("temperature", model_dir, worker_id=worker_id, turn=turn)
    wait_for(lambda: trusted_process(run.learner.log_path, worker_id), 240, f"{worker_id} to pass its probation",
             run.procs)
    turn.touch()
    turned = time.monotonic()
    wait_for(lambda: worker_id in quarantined(run.stats()), 300, f"{worker_id} to be quarantined", run.procs)
    seconds = time.monotonic() - turned
    target = run.ledger_steps() + after_steps
    wait_for(lambda: run.ledger_steps() >= target, 180, "the run to go on with the healthy worker", run.procs)
    proc = run.bad[worker_id]
    assert proc.alive(), proc.log()[-3000:]  # quarantined, not crashed
    proc.stop()
    turned_at = next((int(line["version"]) for line in read_json_lines(proc.log_path)
                      if line.get("event") == "fault_started"), None)
    assert turned_at is not None, f"{proc.log_path}: the fault never started"
    chain, _ = committed_chain(read_ledger(run.run_dir / "learner" / "ledger.jsonl"))
    trained = [(step["step"], max(step["versions"][group])) for step in chain
               for group, worker in step["workers"].items() if worker == worker_id]
    wrong = [step for step, version in trained if version >= turned_at]
    found = audit(run.run_dir, run.learner.log_path, frozenset({worker_id}))
    assert found.first_mismatch_step is not None, found.summary()
    first_wrong = min(wrong + [found.first_mismatch_step])
    return LateFault(turned_at=turned_at, healthy_trained=len(trained) - len(wrong), wrong_trained=len(wrong),
                     steps_to_detect=found.first_mismatch_step - first_wrong + 1,
                     seconds_to_quarantine=round(seconds, 1))
