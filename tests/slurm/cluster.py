"""A one-node Slurm cluster for the tests: Debian's slurm-wlm and munge, run as root from a temporary directory.

:func:`ensure_installed` installs the packages with apt-get the first time (about a minute; a machine that has
``slurmctld`` on PATH skips it, so a CI machine pays the install once). :class:`SlurmCluster` writes a munge key
and a ``slurm.conf`` into its directory (state, spool, logs, pid files, ports all there: nothing under /etc is
used or changed), starts ``munged``, ``slurmctld`` and ``slurmd`` in the foreground as its own children, and on
:meth:`SlurmCluster.stop` cancels every job, waits for them to end, and ends the daemons by pid. The one node
declares ``cpus`` CPUs, more than the machine has (``SlurmdParameters=config_overrides``), so a run's steps and a
second job of workers fit side by side; the CPU count is a scheduling label here, not a reservation. Jobs of
partition ``test`` (the default) are preempted by jobs of partition ``urgent`` and requeued (``PreemptMode=
REQUEUE``, ``GraceTime`` seconds between the SIGTERM and the SIGKILL), as on a cluster with a preemptible queue.

Accounting (slurmdbd) is off, so ``sacct`` has nothing: job state comes from ``squeue`` and ``scontrol show
job``, and finished jobs from the ``jobcomp/filetxt`` file (:meth:`SlurmCluster.completed`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

APT_PACKAGES = ["slurm-wlm", "munge"]
DAEMONS = ["munged", "slurmctld", "slurmd"]


def ensure_installed() -> str | None:
    """Install slurm-wlm and munge if missing; returns why they cannot be (a reason to skip), else None.

    As root with apt-get (CI) an install that fails raises: a root machine must run these tests."""
    if all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS):
        return None
    if os.geteuid() != 0:
        return "slurm-wlm and munge are not installed and installing them needs root (apt-get install slurm-wlm munge)"
    if shutil.which("apt-get") is None:
        return "slurm-wlm and munge are not installed and this machine has no apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *APT_PACKAGES]):
        result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class SlurmCluster:
    root: Path
    cpus: int = 8
    grace_time_s: int = 60  # what a preempted job of partition "test" gets between SIGTERM and SIGKILL
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment of a Slurm client command (sbatch, squeue, ...) aimed at this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> None:
        self.root.chmod(0o755)  # munged wants its socket's directory searchable by all
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket_path = self.root / "munge.sock"
        self._spawn("munged", [_daemon("munged"), "--foreground", "--force", f"--socket={socket_path}",
                               f"--key-file={key}", f"--log-file={self.root / 'log' / 'munged.log'}",
                               f"--pid-file={self.root / 'munged.pid'}", f"--seed-file={self.root / 'munged.seed'}"])
        self._wait(socket_path.exists, timeout_s, "munged to create its socket")
        self.conf.write_text(self._slurm_conf(socket_path))
        self._spawn("slurmctld", [_daemon("slurmctld"), "-D", "-f", str(self.conf)])
        self._spawn("slurmd", [_daemon("slurmd"), "-D", "-f", str(self.conf)])
        self._wait(lambda: self.run("sinfo", "--noheader", "--format=%T", check=False).strip() == "idle",
                   timeout_s, f"node {self.node} to be idle")

    def _slurm_conf(self, munge_socket: Path) -> str:
        r = self.root
        return f"""ClusterName=loraflowtest
SlurmctldHost={self.node}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log' / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobCompType=jobcomp/filetxt
JobCompLoc={r / 'jobcomp.txt'}
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
KillWait=20
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={self.node} CPUs={self.cpus} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={self.grace_time_s}
PartitionName=urgent Nodes={self.node} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""

    def stop(self) -> None:
        """Cancel every job, wait for them to end, then end the daemons (by pid) and any process left of a job."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            with contextlib.suppress(AssertionError):
                self.cancel_all()
        for name in reversed(DAEMONS):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for pid in self.leftover_pids():  # slurmstepd and job tasks are not children of slurmd once started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def cancel_all(self, timeout_s: float = 60.0) -> None:
        """Cancel every job (each test ends with an empty queue, whatever it left running) and wait for it."""
        self.run("scancel", "--full", f"--user={os.geteuid()}", check=False)
        self._wait(lambda: not self.run("squeue", "--noheader", check=False).strip(), timeout_s, "jobs to end")

    def leftover_pids(self) -> list[int]:
        """Processes that carry this cluster's SLURM_CONF (job steps, their tasks) still running."""
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
        return pids

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - owned by the daemon
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        log.close()

    def _wait(self, condition: Callable[[], object], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise AssertionError(f"waiting for {what}: {'dead: ' + ', '.join(dead) if dead else 'timed out'}\n"
                                     f"{self.daemon_logs()}")
            time.sleep(0.2)

    def daemon_logs(self) -> str:
        return "\n".join(f"----- {p.name} -----\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((self.root / "log").glob("*")) if p.is_file())

    # -- client commands ---------------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, env: dict[str, str] | None = None) -> str:
        result = subprocess.run(list(argv), env={**self.env, **(env or {})}, capture_output=True, text=True,
                                timeout=60)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {result.returncode}: {result.stderr}{result.stdout}")
        return result.stdout

    def sbatch(self, script: Path, *options: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submit ``script``; returns the job id."""
        result = subprocess.run(["sbatch", "--parsable", *options, str(script)], env={**self.env, **(env or {})},
                                capture_output=True, text=True, timeout=60, cwd=cwd)
        assert result.returncode == 0, f"sbatch failed: {result.stderr}"
        return result.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        """PENDING, RUNNING, ... from ``squeue`` while the job is known to it, else ``""``."""
        return self.run("squeue", "--noheader", f"--jobs={job_id}", "--format=%T", check=False).strip()

    def show_job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, NodeList, ...)."""
        out = self.run("scontrol", "show", "job", "--oneliner", job_id, check=False)
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def steps(self, job_id: str) -> dict[str, str]:
        """The job's running steps: step name -> step id (``<job>.<step>``)."""
        out = self.run("squeue", "--noheader", "--steps", f"--jobs={job_id}", "--format=%i %j", check=False)
        return {name: step for step, name in (line.split(None, 1) for line in out.splitlines() if line.strip())}

    def completed(self) -> dict[str, dict[str, str]]:
        """Finished jobs from the jobcomp file: job id -> fields (JobState, ExitCode, ...)."""
        path = self.root / "jobcomp.txt"
        if not path.is_file():
            return {}
        jobs = {}
        for line in path.read_text().splitlines():
            fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
            jobs[fields.get("JobId", "")] = fields
        return jobs
