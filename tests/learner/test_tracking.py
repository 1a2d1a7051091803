"""run.report_to: a real learner's step metrics, the held-out evals and the config reach W&B and TensorBoard.

A real learner process trains against the scripted broker with ``report_to = ["wandb", "tensorboard"]`` and
``WANDB_MODE=offline``, while evals.jsonl already holds the launcher's base measurement and gets a periodic one;
after it stops, a "final" line is appended and :func:`loraflow.learner.tracking.log_new_evals` runs, as the launcher does.
Everything is read back from disk: the TensorBoard event files with TensorBoard's own reader, the W&B offline
run files (``run-<id>.wandb``: a LevelDB-style record log of protobuf ``Record`` messages) with the small reader
below. A missing package is a config error at start-up (exit 2, one line with the pip command).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from loraflow.common.config import load_config
from loraflow.learner import tracking
from tests.learner.scripted import ScriptedBroker
from tests.learner.test_learner_runs import learner_argv, metrics_lines
from tests.support import Processes, child_env

NUM_STEPS = 3
EVAL = {"time_unix": 0.0, "seconds": 0.1}


# -- readers ----------------------------------------------------------------------------------------------------

def wandb_records(path: Path) -> list:
    """The protobuf Records of a W&B transaction log: a 7-byte header (':W&B', magic, version), then 32 KiB blocks
    of chunks [crc32 u32, length u16, type u8 (1 full, 2 first, 3 middle, 4 last), data]."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left_in_block = 32768 - pos % 32768
        if left_in_block < 7:
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(records: list) -> list[dict]:
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


def tensorboard_scalars(logdir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def append_eval(run_dir: Path, **line) -> None:
    with open(run_dir / "evals.jsonl", "a") as f:
        f.write(json.dumps({**EVAL, **line}) + "\n")


# -- unit -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("record", "expected"), [
    ({"step": 3, "loss": 0.5}, {"t/step": 3.0, "t/loss": 0.5}),
    ({"staleness": {"0": 2, "1": 1}}, {"t/staleness/0": 2.0, "t/staleness/1": 1.0}),
    ({"batch_id": "b-1", "session": "ab", "kind": "final"}, {}),  # strings are not scalars
    ({"ok": True, "nested": {"deeper": {"x": 1}}}, {"t/ok": 1.0, "t/nested/deeper/x": 1.0}),
])
def test_scalars_flatten_numbers_only(record: dict, expected: dict) -> None:
    assert tracking.scalars(record, "t") == expected


def test_no_report_to_is_a_null_tracker(tmp_path: Path) -> None:
    config = load_config(None, [f"run.run_dir={json.dumps(str(tmp_path))}"])
    assert isinstance(tracking.open_tracker(config), tracking.NullTracker)
    config = load_config(None, [f"run.run_dir={json.dumps(str(tmp_path))}", 'run.report_to=["tensorboard"]'])
    assert isinstance(tracking.open_tracker(config, is_main=False), tracking.NullTracker)
    assert not (tmp_path / "tensorboard").exists()


def test_a_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(tracking.PACKAGES, "wandb", "no_such_package_for_loraflow")
    with pytest.raises(tracking.TrackingUnavailable, match=r"needs wandb, not installed here: "
                                                           r"pip install 'loraflow\[tracking\]'"):
        tracking.check_available(["tensorboard", "wandb"])
    tracking.check_available(["tensorboard"])


def test_each_eval_is_logged_once_across_restarts(tmp_path: Path) -> None:
    """tracking.json remembers how far evals.jsonl was logged (a restarted learner, then the launcher)."""
    config = load_config(None, [f"run.run_dir={json.dumps(str(tmp_path))}", 'run.report_to=["tensorboard"]'])
    append_eval(tmp_path, version=0, step=0, accuracy=0.25, kind="base")
    first = tracking.open_tracker(config)
    first.log_step({"step": 1, "loss": 1.0})
    first.close()
    with open(tmp_path / "evals.jsonl", "a") as f:
        f.write('{"version": 1, "step": 1, "accura')  # torn: the launcher is mid-write
    assert tracking.log_new_evals(config) == 0
    with open(tmp_path / "evals.jsonl", "a") as f:
        f.write('cy": 0.5, "kind": "periodic"}\n')
    assert tracking.log_new_evals(config) == 1
    assert tracking.log_new_evals(config) == 0
    events = tensorboard_scalars(tmp_path / "tensorboard")
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(0, 0.25), (1, 0.5)]
    assert json.loads((tmp_path / "tracking.json").read_text())["evals_logged"] == 2


# -- the real learner -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tracked_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("tracked")
    run_dir = tmp / "run"
    run_dir.mkdir()
    append_eval(run_dir, version=0, step=0, accuracy=0.25, kind="base")  # measured before the learner starts
    procs = Processes(tmp)
    broker = ScriptedBroker(seed=5)
    env = child_env(WANDB_MODE="offline", WANDB_PROJECT="loraflow-tests", WANDB_SILENT="true")
    try:
        proc = procs.spawn("learner", learner_argv(run_dir, broker.endpoint, tiny_model_dir,
                                                   f"run.num_steps={NUM_STEPS}", "learner.checkpoint_every=0",
                                                   'run.report_to=["wandb", "tensorboard"]', "run.name=tracked"),
                           env=env)
        append_eval(run_dir, version=1, step=1, accuracy=0.5, kind="periodic")  # while it trains
        assert proc.wait(240) == 0, proc.log()[-4000:]
    finally:
        broker.close()
        procs.cleanup()
    # the launcher, after the learner stopped: its final measurement, then the trackers get it
    append_eval(run_dir, version=NUM_STEPS, step=NUM_STEPS, accuracy=0.75, kind="final")
    config = load_config(run_dir / "learner" / "config.toml")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            if key.startswith("WANDB_"):
                mp.setenv(key, value)
        assert tracking.log_new_evals(config) == 1
    return run_dir


def test_tensorboard_gets_steps_evals_and_config(tracked_run: Path) -> None:
    steps = metrics_lines(tracked_run)
    events = tensorboard_scalars(tracked_run / "tensorboard")
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([m["loss"] for m in steps], rel=1e-6)
    assert [e.value for e in events.Scalars("train/grad_norm")] == pytest.approx([m["grad_norm"] for m in steps],
                                                                                 rel=1e-6)
    assert [e.value for e in events.Scalars("train/version")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("train/staleness/0")] == [1]  # a nested table, flattened
    accuracy = events.Scalars("eval/accuracy")
    assert [(e.step, e.value) for e in accuracy] == [(0, 0.25), (1, 0.5), (3, 0.75)]
    assert "config/text_summary" in events.Tags()["tensors"]
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "lora_rank = 8" in config_text and 'report_to = ["wandb", "tensorboard"]' in config_text


def test_wandb_offline_run_holds_steps_evals_and_config(tracked_run: Path) -> None:
    run_id = json.loads((tracked_run / "tracking.json").read_text())["wandb_run_id"]
    files = sorted((tracked_run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2, files  # the learner's, then the launcher's final evaluation: one run id
    learner_records, launcher_records = wandb_records(files[0]), wandb_records(files[1])
    runs = [r.run for r in learner_records if r.WhichOneof("record_type") == "run"]
    assert runs and runs[0].run_id == run_id and runs[0].display_name == "tracked"
    assert runs[0].project == "loraflow-tests"
    config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
    assert config["learner"]["lora_rank"] == 8 and config["run"]["report_to"] == ["wandb", "tensorboard"]

    history = wandb_history(learner_records)
    train = [h for h in history if "train/loss" in h]
    steps = metrics_lines(tracked_run)
    assert [h["train/step"] for h in train] == [1, 2, 3]
    assert [h["train/loss"] for h in train] == pytest.approx([m["loss"] for m in steps], rel=1e-6)
    evals = [(h["eval/step"], h["eval/accuracy"]) for h in history if "eval/accuracy" in h]
    assert evals == [(0, 0.25), (1, 0.5)]
    final = [(h["eval/step"], h["eval/accuracy"]) for h in wandb_history(launcher_records) if "eval/accuracy" in h]
    assert final == [(3, 0.75)]


def test_report_to_without_the_package_exits_2_before_loading_the_model(procs: Processes, tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None  # as if not installed\n")
    env = child_env()
    env["PYTHONPATH"] = f"{hide}:{env['PYTHONPATH']}"
    proc = procs.spawn("learner", learner_argv(tmp_path / "run", "tcp://127.0.0.1:1", tiny_model_dir,
                                               'run.report_to=["wandb"]'), env=env)
    assert proc.wait(120) == 2, proc.log()[-3000:]
    lines = [line for line in proc.log().splitlines() if "pip install 'loraflow[tracking]'" in line]
    assert len(lines) == 1 and "run.report_to = ['wandb'] needs wandb" in lines[0], proc.log()
    assert "Traceback" not in proc.log()
