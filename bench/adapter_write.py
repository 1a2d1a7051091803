"""The broker's durable write of a new adapter (``loraflow.broker.state.save_adapter``: frames, fsync, rename) on this disk.

    .venv/bin/python -m bench.adapter_write [--mb 37] [--tensors 392] [--repeats 8] [--dir DIR]

An AdapterAck waits for the state write that covers the adapter (``loraflow.broker.state.StateWriter``), so this is the
disk's part of "adapter at the broker after a publish" (the learner's ``adapter_ack_s``). Defaults: the 1.5B
shape's rank-16 adapter on every linear as ``bench/gpu_smoke.sh`` publishes it (37 MB in 392 tensors, plus a
header frame). Reference, same run, same directory: the same bytes written without the fsync and the rename.
Last line: value = median ms of ``save_adapter``, reference = median ms without fsync.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.report import report
from loraflow.broker.state import save_adapter

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = harness.parser(__doc__, repeats=8)
    parser.add_argument("--mb", type=float, default=37.0, help="adapter size in MB")
    parser.add_argument("--tensors", type=int, default=392)
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = harness.parse(parser, None, mb=2.0, tensors=20, repeats=2)
    per_tensor = int(args.mb * 1e6) // args.tensors
    frames = [os.urandom(64)] + [os.urandom(per_tensor) for _ in range(args.tensors)]
    durable, plain = [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        target, scratch = Path(where) / "adapter.bin", Path(where) / "plain.bin"
        for _ in range(args.repeats):  # interleaved: the disk's load hits both alike
            started = time.perf_counter()
            save_adapter(target, frames)
            durable.append(time.perf_counter() - started)
            started = time.perf_counter()
            with open(scratch, "wb") as f:
                for frame in frames:
                    f.write(frame)
            plain.append(time.perf_counter() - started)
    value, reference = statistics.median(durable) * 1e3, statistics.median(plain) * 1e3
    print(f"{sum(map(len, frames)) / 1e6:.1f} MB in {len(frames)} frames at {where}: save_adapter (fsync, rename) "
          f"median {value:.1f} ms, max {max(durable) * 1e3:.1f} ms | the same bytes without fsync median "
          f"{reference:.1f} ms (x{args.repeats})")
    report("adapter_write", "save_adapter_ms", value, "ms", reference, max_ms=round(max(durable) * 1e3, 2),
           mb=args.mb, tensors=args.tensors, repeats=args.repeats)


if __name__ == "__main__":
    main()
