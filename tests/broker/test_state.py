"""The persisted state: atomic round trips, refusal of foreign or corrupt files, the background writer."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from loraflow.broker.state import (
    StateWriter,
    check_matches,
    load_adapter,
    load_state,
    make_state,
    save_adapter,
    save_state,
)


def state(**changes):
    fields = dict(task="arith", seed=0, epoch_size=None, cursor=(0, 10), reserved_until=(0, 20),
                  pending=[(0, 3), (0, 7)], latest_version=2, num_trained_groups=8)
    fields.update(changes)
    return make_state(**fields)


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "broker" / "state.json"
    assert load_state(path) is None
    save_state(path, state())
    loaded = load_state(path)
    assert loaded.cursor_key == (0, 10) and loaded.reserved_key == (0, 20)
    assert loaded.pending_keys() == [(0, 3), (0, 7)]
    assert (loaded.latest_version, loaded.num_trained_groups, loaded.epoch_size) == (2, 8, 0)
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]  # no temp file left behind


@pytest.mark.parametrize("content, match", [
    ("{not json", "not a valid broker state file"),
    ('{"task": "arith"}', "required field is missing"),
    ('{"task": "arith", "seed": 0, "cursor": [0, 5], "reserved_until": [0, 5], "extra": 1}', "unknown field"),
    ('{"task": "arith", "seed": 0, "cursor": [0, 5], "reserved_until": [0, 4]}', "is before cursor"),
    ('{"task": "arith", "seed": 0, "cursor": [0, 5], "reserved_until": [0, 5], "format": 9}', "must be <= 1"),
    # a version a token's int32 cannot carry (published before versions were bounded): refused, not served
    ('{"task": "arith", "seed": 0, "cursor": [0, 5], "reserved_until": [0, 5], "latest_version": 2147483648}',
     r"latest_version: must be <= 2147483647, got 2147483648\); move it away"),
])
def test_corrupt_files_are_refused(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "state.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_state(path)


@pytest.mark.parametrize("task, seed, epoch_size, ok", [
    ("arith", 0, None, True), ("calculator", 0, None, False), ("arith", 1, None, False), ("arith", 0, 50, False),
])
def test_foreign_state_is_refused(task: str, seed: int, epoch_size: int | None, ok: bool) -> None:
    if ok:
        check_matches(state(), task=task, seed=seed, epoch_size=epoch_size, path="s.json")
    else:
        with pytest.raises(ValueError, match="was written for run.task='arith'"):
            check_matches(state(), task=task, seed=seed, epoch_size=epoch_size, path="s.json")


def test_writer_background_then_sync_newest_wins(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    durable = threading.Event()
    writer = StateWriter(path, on_durable=durable.set)
    seq = writer.submit(state(latest_version=5))
    assert durable.wait(10)
    assert writer.durable_seq >= seq and load_state(path).latest_version == 5
    sync_seq = writer.write(state(latest_version=6))
    assert sync_seq > seq and writer.durable_seq == sync_seq
    for version in range(7, 20):
        last = writer.submit(state(latest_version=version))
    writer.close()  # finishes the pending write
    assert writer.durable_seq == last
    assert json.loads(path.read_text())["latest_version"] == 19
    assert writer.num_writes <= 2 + 13
    with pytest.raises(RuntimeError, match="closed"):
        writer.submit(state())
    writer.write(state(latest_version=30))  # synchronous writes still work after close (shutdown)
    assert load_state(path).latest_version == 30


def test_adapter_file_round_trip_and_torn_file(tmp_path: Path) -> None:
    path = tmp_path / "adapter.bin"
    assert load_adapter(path) is None
    frames = [b"preamble", b"", memoryview(bytes(range(256)) * 4)]
    save_adapter(path, frames)
    assert load_adapter(path) == [b"preamble", b"", bytes(range(256)) * 4]
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated"):
        load_adapter(path)
    path.write_bytes(b"something else")
    with pytest.raises(ValueError, match="not a saved adapter"):
        load_adapter(path)


def test_writer_saves_the_adapter_before_the_state(tmp_path: Path) -> None:
    writer = StateWriter(tmp_path / "state.json")
    writer.submit(state(latest_version=3), adapter=(3, [b"a", b"b"]))
    writer.submit(state(latest_version=3))  # replaces the pending state, keeps the pending adapter
    writer.close()
    assert load_adapter(tmp_path / "adapter.bin") == [b"a", b"b"]
    assert load_state(tmp_path / "state.json").latest_version == 3
    writer.write(state(latest_version=3), adapter=(2, [b"older"]))  # never goes back
    assert load_adapter(tmp_path / "adapter.bin") == [b"a", b"b"]


def test_writer_group_commits_within_its_interval(tmp_path: Path) -> None:
    """States submitted faster than min_interval_s share writes; a write after a quiet interval starts at once."""
    interval_s = 0.5
    writer = StateWriter(tmp_path / "state.json", min_interval_s=interval_s)

    def wait_durable(seq: int) -> float:
        started = time.monotonic()
        while writer.durable_seq < seq and time.monotonic() - started < 10:
            time.sleep(0.005)
        return time.monotonic() - started

    wait_durable(writer.submit(state(latest_version=1)))
    for version in range(2, 40):  # 38 submissions within the interval that follows the first write
        last = writer.submit(state(latest_version=version))
    assert wait_durable(last) >= 0.8 * interval_s  # the next write waited for the interval ...
    assert writer.num_writes == 2  # ... and covered all 38
    assert load_state(tmp_path / "state.json").latest_version == 39
    time.sleep(1.1 * interval_s)
    assert wait_durable(writer.submit(state(latest_version=40))) < 0.8 * interval_s  # nothing left to wait for
    writer.close()
