"""Plots from a run directory, busy spans from timelines, and the progress line against a real broker."""

from __future__ import annotations

import io
import json
from pathlib import Path

from loraflow.deploy import rundir
from loraflow.deploy.plots import plot_run
from loraflow.deploy.progress import Display, MetricsTail, Progress, Snapshot, render
from tests.support import Processes, start_broker

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_jsonl(path: Path, items: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(i) + "\n" for i in items))


def fake_run(run_dir: Path) -> None:
    t0 = 1_800_000_000.0
    write_jsonl(rundir.metrics_path(run_dir), [
        {"step": s, "version": s, "time_unix": t0 + s, "reward_mean": s / 10, "staleness": {"0": 10, "1": 6}}
        for s in range(1, 9)])
    write_jsonl(rundir.evals_path(run_dir), [
        {"version": 0, "step": 0, "accuracy": 0.3, "time_unix": t0, "kind": "base"},
        {"version": 8, "step": 8, "accuracy": 0.9, "time_unix": t0 + 9, "kind": "final"}])
    write_jsonl(run_dir / "timeline" / "learner.jsonl", [
        {"t": t0, "state": "starting", "pid": 10}, {"t": t0 + 1, "state": "waiting"},
        {"t": t0 + 2, "state": "training"}, {"t": t0 + 4, "state": "waiting"}, {"t": t0 + 10, "alive": 1}])
    write_jsonl(run_dir / "timeline" / "worker-1.jsonl", [
        {"t": t0, "state": "starting"}, {"t": t0 + 1, "state": "generating"}, {"t": t0 + 3, "state": "waiting"}])
    write_jsonl(rundir.processes_path(run_dir), [
        {"t": t0, "process": "worker-1", "event": "start"}, {"t": t0 + 5, "process": "worker-1", "event": "exit"}])
    (run_dir / "timeline" / "worker-2.jsonl").write_text('{"t": 1800000000.0, "state": "generating"}\n{"t": 18')


def test_plots_are_drawn_from_a_run_directory(tmp_path: Path) -> None:
    fake_run(tmp_path)
    paths = plot_run(tmp_path)
    assert [p.name for p in paths] == ["learning.png", "staleness.png", "timeline.png"]
    for path in paths:
        assert path.read_bytes().startswith(PNG_MAGIC) and path.stat().st_size > 5000


def test_plots_of_an_empty_run_directory_do_not_fail(tmp_path: Path) -> None:
    assert all(p.is_file() for p in plot_run(tmp_path))


def test_timelines_busy_spans_and_exits(tmp_path: Path) -> None:
    fake_run(tmp_path)
    t0 = 1_800_000_000.0
    lanes = rundir.timelines(tmp_path, now_s=t0 + 100)
    assert list(lanes) == ["learner", "worker-1", "worker-2"]  # torn last line of worker-2 skipped
    learner = lanes["learner"]
    assert learner.spans() == [
        (t0, t0 + 1, "starting"), (t0 + 1, t0 + 2, "waiting"), (t0 + 2, t0 + 4, "training"),
        (t0 + 4, t0 + 10, "waiting")]  # to its last alive line, not to the end of the run
    assert learner.busy_share() == 2 / 9  # start-up not counted
    assert [life.ended for life in learner.lives] == ["lost"]  # no final mark, no exit record, long silent
    worker = lanes["worker-1"]  # its exit record (processes.jsonl) ends it
    assert worker.spans()[-1] == (t0 + 3, t0 + 5, "waiting") and worker.lives[0].ended == "exited"
    assert worker.busy_share() == 2 / 4


def test_newest_adapter_ignores_partial_directories(tmp_path: Path) -> None:
    root = rundir.adapters_root(tmp_path)
    for name in ("v000010", "v000020", ".tmp-v000030-1", "v000040"):
        (root / name).mkdir(parents=True)
    for name in ("v000010", "v000020", ".tmp-v000030-1"):
        (root / name / "adapter_config.json").write_text("{}")
    assert rundir.newest_adapter(tmp_path) == (20, root / "v000020")  # v40 has no config yet
    assert rundir.newest_adapter(tmp_path / "nothing") == (0, None)


def test_metrics_tail_reads_only_complete_new_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tail = MetricsTail(path)
    assert tail.read_new() == []
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert [x["step"] for x in tail.read_new()] == [1, 2]
    with open(path, "a") as f:
        f.write('ep": 3}\n')
    assert [x["step"] for x in tail.read_new()] == [3]
    assert tail.read_new() == []


def test_progress_from_a_real_broker_and_metrics(procs: Processes, tmp_path: Path) -> None:
    broker = start_broker(procs, "run.groups_per_step=4", "run.max_staleness=1")
    write_jsonl(rundir.metrics_path(tmp_path), [
        {"step": 1, "version": 1, "reward_mean": 0.25, "staleness": {"1": 2, "0": 2}},
        {"step": 2, "version": 2, "reward_mean": 0.75, "staleness": {"0": 4}}])
    progress = Progress(tmp_path, broker.endpoint)
    progress.set_accuracy(0.625, 2)
    snap = progress.poll(stats_timeout_s=5.0)
    assert (snap.step, snap.version, snap.reward_mean) == (2, 2, 0.5)
    assert snap.buffer_groups == 0 and snap.capacity_groups == 8 and snap.num_workers == 0
    line = render(snap)
    assert "step 2" in line and "reward 0.50" in line and "acc 62.5% (v2)" in line and "buffer 0/8" in line
    assert "staleness 0:4" in line
    unreachable = Progress(tmp_path, "tcp://127.0.0.1:1").poll(stats_timeout_s=0.2)
    assert unreachable.buffer_groups is None  # a broker that is not there shows as unknown, not an error


def test_render_before_anything_is_known() -> None:
    assert render(Snapshot()).startswith("[    0s] step -  v-  reward -  acc -  - tok/s  buffer -")


def test_display_prints_periodically_into_files() -> None:
    out = io.StringIO()
    display = Display(out, every_s=3600, interactive=False)
    display.status("first")
    display.status("second")  # within the period: not printed
    display.event("an event")
    display.status("third", force=True)
    assert out.getvalue().splitlines() == ["first", "an event", "third"]
    tty = io.StringIO()
    display = Display(tty, interactive=True)
    display.status("a")
    display.event("b")
    display.close()
    assert tty.getvalue() == "\r\x1b[2Ka\r\x1b[2Kb\n"
