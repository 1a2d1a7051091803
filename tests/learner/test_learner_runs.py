"""Learner processes against a scripted broker: 1 rank vs 2 ranks (torchrun, gloo), SIGKILL + resume, SIGTERM.

The scripted broker (tests/learner/scripted.py) serves the same deterministic batches to every run, so:

- run A (one process) and run B (torchrun, 2 ranks) must report the same loss and gradient norm each step
  and publish the same adapters within 1e-5. The runs use ``adam_eps=1e-5``: the two sum the same gradient
  in a different order, and Adam divides each entry by its own magnitude, so an entry that is ~1e-9 by
  chance would turn a rounding difference into a step of a sizeable fraction of the lr (seen: 1.8e-4 at the
  first step with eps 1e-8; 6e-7 after five steps with 1e-5), which says nothing about the learner;
- run C is SIGKILLed after step 3 (checkpoint at step 2), restarted with resume, fed the batches that followed
  its checkpoint, and must publish bit-identical adapters for steps 3-5 to run A's; it first republishes its
  checkpoint's weights under a new number (version 3, published after the checkpoint, is withdrawn); then
  SIGTERM stops it cleanly (exit 0, final checkpoint and adapter directory).
"""

from __future__ import annotations

import hashlib
import json
import re
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from loraflow.common.cli import one_host_torchrun
from loraflow.deploy import rundir
from tests.learner.scripted import ScriptedBroker
from tests.support import Processes, wait_for

NUM_STEPS = 5
COMMON = ["run.groups_per_step=2", "run.group_size=4", "run.max_staleness=100", "learner.lora_rank=8",
          "learner.micro_batch_tokens=64", "learner.checkpoint_every=2", "learner.kl_beta=0.01",
          "learner.off_policy=\"tis\"", "learner.save_adapter_every=2", "learner.warmup_steps=2",
          "learner.adam_eps=1e-5",
          # the scripted batches are random tokens with made-up log-probs and no evidence, which the policy check
          # refuses; tests/learner/test_integrity_check.py runs this learner with the check on and honest groups
          "integrity.check=false",
          'security.run_token="scripted-broker"']  # the scripted broker writes no run token file (common/run_token.py)


def learner_argv(run_dir: Path, endpoint: str, model_dir: Path, *overrides: str, ranks: int = 1) -> list[str]:
    args = ["--run-dir", str(run_dir), "--endpoint", endpoint, "--model", str(model_dir)]
    for override in (*COMMON, *overrides):
        args += ["--set", override]
    if ranks == 1:
        return [sys.executable, "-m", "loraflow.learner", *args]
    return [sys.executable, *one_host_torchrun(ranks), "-m", "loraflow.learner", *args]


def metrics_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]


@dataclass
class Run:
    broker: ScriptedBroker
    run_dir: Path
    returncode: int
    log: str


def run_to_completion(procs: Processes, name: str, run_dir: Path, model_dir: Path, ranks: int) -> Run:
    broker = ScriptedBroker(seed=11)
    try:
        proc = procs.spawn(name, learner_argv(run_dir, broker.endpoint, model_dir, f"run.num_steps={NUM_STEPS}",
                                              ranks=ranks))
        returncode = proc.wait(240)
    finally:
        broker.close()
    return Run(broker, run_dir, returncode, proc.log())


@pytest.fixture(scope="module")
def reference_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Run A (1 process) and run B (2 ranks) on the same batches, once for the module."""
    tmp = tmp_path_factory.mktemp("learner-runs")
    procs = Processes(tmp)
    try:
        one = run_to_completion(procs, "one-rank", tmp / "one", tiny_model_dir, ranks=1)
        two = run_to_completion(procs, "two-ranks", tmp / "two", tiny_model_dir, ranks=2)
    finally:
        procs.cleanup()
    assert one.returncode == 0, one.log[-4000:]
    assert two.returncode == 0, two.log[-4000:]
    return one, two


def test_learner_publishes_in_order_and_acknowledges_every_batch(reference_runs) -> None:
    one, _ = reference_runs
    broker = one.broker
    assert broker.hellos[0].role == "learner" and broker.hellos[0].adapter_version == 0
    assert [p.version for p in broker.published] == [1, 2, 3, 4, 5]
    assert [p.step for p in broker.published] == [1, 2, 3, 4, 5]
    for p in broker.published:  # the checksum covers the tensor bytes in order
        digest = hashlib.sha256()
        for tensor in p.tensors.values():
            digest.update(tensor.tobytes())
        assert digest.hexdigest() == p.sha256
        assert p.adapter_config["peft_type"] == "LORA" and p.adapter_config["r"] == 8
    assert [a.batch_id for a in broker.acks] == [f"batch-{i}" for i in range(NUM_STEPS)]
    assert [a.step for a in broker.acks] == [1, 2, 3, 4, 5]
    assert [a.trained_version for a in broker.acks] == [0, 1, 2, 3, 4]
    assert [a.checkpoint_version for a in broker.acks] == [0, 2, 2, 4, 4]
    assert [sorted(a.group_ids) for a in broker.acks] == [[f"{i}:0", f"{i}:1"] for i in range(NUM_STEPS)]
    assert broker.served == list(range(NUM_STEPS))  # no batch requested beyond run.num_steps
    assert [b.reason for b in broker.byes] == ["stopped"]

    learner_dir = one.run_dir / "learner"
    assert sorted(p.name for p in (learner_dir / "checkpoints").iterdir()) == ["step_00000004", "step_00000005"]
    assert sorted(p.name for p in (learner_dir / "adapters").iterdir()) == ["v000002", "v000004", "v000005"]
    lines = metrics_lines(one.run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5] and [m["version"] for m in lines] == [1, 2, 3, 4, 5]
    for m in lines:
        assert m["num_tokens"] > 0 and m["grad_norm"] > 0 and m["entropy"] > 0 and m["kl"] >= 0
        assert m["wait_s"] >= 0 and m["compute_s"] > 0 and m["publish_s"] > 0
        assert m["staleness"] == {str(m["step"] - 1): 2}  # the scripted groups are all of version 0
        assert 0 <= m["clip_frac"] <= 1 and m["is_weight_max"] >= m["is_weight_mean"] > 0
    assert lines[0]["lr"] < lines[-1]["lr"]  # warmup
    # a step's line is written before its checkpoint (a kill in between leaves the committed step its line); the
    # checkpoint's seconds are in the next line
    assert [m["checkpoint_s"] > 0 for m in lines] == [False, False, True, False, True]
    logged = [(e, n) for e, n in re.findall(r"\] (step|checkpoint_saved)\s.*?step=(\d+)", one.log)]
    assert logged.index(("step", "2")) < logged.index(("checkpoint_saved", "2"))
    timeline = (one.run_dir / "timeline" / "learner.jsonl").read_text()
    assert all(f'"{state}"' in timeline for state in ("waiting", "training", "publishing", "stopping"))


def test_one_and_two_ranks_train_the_same_adapter(reference_runs) -> None:
    one, two = reference_runs
    # Adam would hide a wrong gradient scale in the parameters; the loss and gradient norm do not
    for a, b in zip(metrics_lines(one.run_dir), metrics_lines(two.run_dir), strict=True):
        assert b["num_tokens"] == a["num_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-5)
    assert [p.version for p in two.broker.published] == [1, 2, 3, 4, 5]
    moved = 0.0
    for a, b in zip(one.broker.published, two.broker.published, strict=True):
        assert a.tensors.keys() == b.tensors.keys()
        worst = max(float(np.abs(a.tensors[n] - b.tensors[n]).max()) for n in a.tensors)
        assert worst < 1e-5, f"step {a.step}: 1 vs 2 ranks differ by {worst}"
        moved = max(moved, max(float(np.abs(a.tensors[n]).max()) for n in a.tensors if "lora_B" in n))
    assert moved > 1e-3  # the adapter did train (lora_B starts at zero)


def test_sigkill_then_resume_is_bit_identical_and_sigterm_is_clean(reference_runs, tiny_model_dir: Path,
                                                                   procs: Processes, tmp_path: Path) -> None:
    one, _ = reference_runs
    run_dir = tmp_path / "killed"
    broker = ScriptedBroker(seed=11, allowed_batches=3)
    try:
        argv = learner_argv(run_dir, broker.endpoint, tiny_model_dir, "run.num_steps=0")
        first = procs.spawn("learner-first", argv)
        wait_for(lambda: any(a.step == 3 for a in broker.acks), 120, "step 3 acknowledged", procs)
        first.kill()  # SIGKILL between the checkpoints of steps 2 and 4
        assert first.popen.returncode == -signal.SIGKILL
        broker.forget_waiting()
        first_life = dict(broker.by_step())
        # a save that crashed half-way must not be picked
        (run_dir / "learner" / "checkpoints" / "step_00000003.partial").mkdir()
        broker.allow(NUM_STEPS)
        second = procs.spawn("learner-second", argv)
        wait_for(lambda: any(a.step == NUM_STEPS for a in broker.acks), 120, "step 5 acknowledged", procs)
        second.signal(signal.SIGTERM)
        assert second.wait(60) == 0, second.log()[-4000:]
    finally:
        broker.close()
    assert [h.adapter_version for h in broker.hellos] == [0, 2]  # resumed at the step-2 checkpoint
    assert broker.served == [0, 1, 2, 2, 3, 4]  # the batches after the checkpoint, fed again
    versions = [p.version for p in broker.published]
    assert versions == sorted(set(versions)) == [1, 2, 3, 4, 5, 6, 7]  # numbering continues after version 3
    # version 3 (step 3) was lost with the process: withdrawn, and the checkpoint's weights come back as version 4
    resumed = broker.published[3]
    assert (resumed.version, resumed.step, resumed.sha256) == (4, 2, first_life[2].sha256)
    reference = {p.step: p.sha256 for p in one.broker.published}
    assert {s: p.sha256 for s, p in first_life.items()} == {s: reference[s] for s in (1, 2, 3)}
    assert {s: p.sha256 for s, p in broker.by_step().items()} == reference  # steps 3-5 bit-identical
    checkpoints = sorted(p.name for p in (run_dir / "learner" / "checkpoints").iterdir())
    assert checkpoints == ["step_00000004", "step_00000005"]  # final checkpoint on SIGTERM; partial cleaned
    assert (run_dir / "learner" / "adapters" / "v000007" / "adapter_model.safetensors").is_file()
    assert [b.reason for b in broker.byes] == ["stopped"]
    # metrics.jsonl read back as history: steps 1-2 of the first life, 3-5 of the second, each once (step 3 of
    # the first life, if it got its line before the kill, is withdrawn); the timeline shows the death
    history = rundir.read_learner_history(run_dir)
    sessions = [h.session for h in broker.hellos]
    assert [(m["step"], m["session"]) for m in history.committed] == [
        (1, sessions[0]), (2, sessions[0]), (3, sessions[1]), (4, sessions[1]), (5, sessions[1])]
    assert [m["step"] for m in history.withdrawn] in ([], [3]) and [r.step for r in history.resumes] == [2]
    assert [life.ended for life in rundir.timelines(run_dir)["learner"].lives] == ["lost", "stopped"]


def test_a_batch_trained_already_is_acknowledged_without_a_step(tiny_model_dir: Path, procs: Processes,
                                                                tmp_path: Path) -> None:
    """A learner resuming from its checkpoint against a broker that serves its checkpointed groups again (a
    BatchAck lost with a killed learner: here a broker whose batches 2 and 3 are batches 0 and 1 again)
    acknowledges those batches without counting a step (``batch_replayed``), so ``run.num_steps`` buys new
    training: step 3 trains batch 2's groups, not a replay."""
    from tests.learner.scripted import make_batch

    run_dir = tmp_path / "replayed"
    first = ScriptedBroker(seed=11)
    try:
        argv = learner_argv(run_dir, first.endpoint, tiny_model_dir, "run.num_steps=2", "learner.checkpoint_every=1")
        assert procs.spawn("learner-first", argv).wait(240) == 0
    finally:
        first.close()
    again = [make_batch(11, i, num_groups=2, group_size=4) for i in (0, 1, 0, 1, 2)]  # resumed at v2: from [2]
    second = ScriptedBroker(seed=11, batches=again)
    try:
        argv = learner_argv(run_dir, second.endpoint, tiny_model_dir, "run.num_steps=3", "learner.checkpoint_every=1")
        learner = procs.spawn("learner-second", argv)
        assert learner.wait(240) == 0, learner.log()[-4000:]
    finally:
        second.close()
    assert second.served == [2, 3, 4]
    assert [(a.batch_id, a.step) for a in second.acks] == [("batch-0", 2), ("batch-1", 2), ("batch-2", 3)]
    assert sorted(second.acks[0].group_ids) == ["0:0", "0:1"] and learner.log().count("batch_replayed") == 2
    steps = [line for line in map(json.loads, (run_dir / "learner" / "ledger.jsonl").read_text().splitlines())
             if line["event"] == "step"]
    assert [(s["step"], sorted(s["trained"] + s["zero_variance"])) for s in steps] == [
        (1, ["0:0", "0:1"]), (2, ["1:0", "1:1"]), (3, ["2:0", "2:1"])]


def test_a_target_module_that_matches_nothing_exits_2_with_the_setting_named(procs: Processes, tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    """Exit code 2 tells supervisors (loraflow run, systemd) that restarting cannot help."""
    proc = procs.spawn("learner-bad", learner_argv(tmp_path / "run", "tcp://127.0.0.1:1", tiny_model_dir,
                                                   'learner.target_modules=["no_such_proj"]'))
    assert proc.wait(120) == 2, proc.log()
    assert "learner.target_modules" in proc.log() and "no_such_proj" in proc.log()
