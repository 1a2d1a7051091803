"""The broker's durable write of a new adapter (``loraflow.broker.state.save_adapter``: frames, fsync, rename).

An AdapterAck waits for the state write that covers the adapter, so this is the disk's part of "adapter at the
broker after a publish". Defaults: the 1.5B shape's rank-16 adapter as ``bench/gpu_smoke.sh`` publishes it (37 MB
in 392 tensors plus a header frame). Reference, interleaved in the same directory: the same bytes written without
fsync and rename. Last line: value = median ms of ``save_adapter``, reference = median ms without fsync.

    .venv/bin/python -m bench.adapter_write [--mb 37] [--tensors 392] [--repeats 8] [--dir DIR]
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench import harness
from loraflow.broker.state import save_adapter


def timed(write: Callable[[], object]) -> float:
    started = time.perf_counter()
    write()
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    p = harness.flags(harness.parser(__doc__, repeats=8), {"mb": (37.0, "adapter size in MB"), "tensors": 392})
    p.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = harness.parse(p, None, mb=2.0, tensors=20, repeats=2)
    frames = [os.urandom(64)] + [os.urandom(int(args.mb * 1e6) // args.tensors) for _ in range(args.tensors)]
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        def plain() -> None:
            with open(Path(where) / "plain.bin", "wb") as f:
                for frame in frames:
                    f.write(frame)

        runs = harness.interleave({"durable": lambda: timed(lambda: save_adapter(Path(where) / "adapter.bin", frames)),
                                   "plain": lambda: timed(plain)}, args.repeats)
    value, reference = harness.median(runs["durable"]), harness.median(runs["plain"])
    harness.table(["MB", "frames", "save_adapter median ms", "max ms", "no fsync median ms"],
                  [[f"{sum(map(len, frames)) / 1e6:.1f}", len(frames), f"{value:.1f}", f"{max(runs['durable']):.1f}",
                    f"{reference:.1f}"]])
    harness.report("adapter_write", "save_adapter_ms", value, "ms", reference, max_ms=round(max(runs["durable"]), 2),
                   mb=args.mb, tensors=args.tensors, repeats=args.repeats)


if __name__ == "__main__":
    main()
