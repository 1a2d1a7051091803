"""An hf worker's adapter load and generation with a busy thread in the process, against the same with none.

    .venv/bin/python -m bench.adapter_load [--layers 28] [--dtype float32] [--swaps 6] [--reference-tree DIR]

A worker process is never one thread: its broker session receives, verifies and writes the next adapter while
the main loop loads the last one. Every torch call releases the GIL, and a busy Python thread then keeps it for
up to the interpreter's switch interval (5 ms), so a load's cost grows with the number of torch calls it makes,
not with its bytes. The model has the tensor count of a 1.5B model's adapter (392 tensors) on a tiny shape
(``--layers`` decoder layers of hidden 128, rank-16 LoRA on all seven projections: 14 tensors a layer), so the
figure is about calls, not bandwidth.

Each version is loaded into :class:`loraflow.rollout_worker.backends.hf.HfBackend` as the worker does (``add_adapter``
from the PEFT directory, then ``retain`` of the new version only, so slots are reused), first with no other
thread, then with one Python thread spinning. Loads that create a slot (the first two) are left out; the figure
is the median of the rest, with the backend's own split (``load_phases_ms``) of the last load.
``--reference-tree DIR`` runs the same measurement with another checkout's code (e.g. a ``git worktree`` of the
commit before a change) in a child process, for a before/after in one run.

The same backend then generates 16 samples of ``--generate-tokens`` tokens alone and beside the busy thread: what
a reward or agent that runs away past its timeout costs an hf worker (why the worker restarts then:
``loraflow.rollout_worker.rewards.guard.RunawayWatch``).

Last line: value = median load (ms) with the busy thread, reference = without, ratio = value / reference;
``generate_tok_s_idle`` / ``generate_tok_s_busy`` beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import REPO, report


def build(work: Path, layers: int, versions: int) -> tuple[Path, list[Path]]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loraflow.common.tiny_model import TinyShape, build_tiny_model

    model = build_tiny_model(work / "model", shape=TinyShape(num_hidden_layers=layers))
    dirs = []
    for version in range(1, versions + 1):
        base = AutoModelForCausalLM.from_pretrained(str(model))
        torch.manual_seed(version)
        lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
        get_peft_model(base, lora).save_pretrained(str(work / f"v{version}"))
        dirs.append(work / f"v{version}")
    return model, dirs


def measure(model: Path, dirs: list[Path], dtype: str, generate_tokens: int) -> dict[str, Any]:
    """Load every version without, then with, a spinning thread (medians after the slot-creating loads); then
    generate 16 samples of ``generate_tokens`` tokens without, then with, one."""
    import torch

    from loraflow.rollout_worker.adapters import WEIGHTS_FILE
    from loraflow.rollout_worker.backends.base import GenRequest, Sampling
    from loraflow.rollout_worker.backends.hf import HfBackend

    torch.set_num_threads(1)
    backend = HfBackend(model, sampling=Sampling(), device="cpu", dtype=dtype)
    out: dict[str, Any] = {}
    for busy in (False, True):
        with spinning(busy):
            times = load_each(backend, dirs)
        backend.retain(set())
        later = times[2:]
        out["busy" if busy else "idle"] = {"median_ms": round(statistics.median(later), 2),
                                           "max_ms": round(max(later), 2),
                                           "phases_ms": getattr(backend, "load_phases_ms", {})}
    out["num_tensors"] = len(set(json.loads(_header(dirs[0] / WEIGHTS_FILE))) - {"__metadata__"})
    requests = [GenRequest(token_ids=backend.encode("12+34="), max_tokens=generate_tokens, version=0, key=f"s{i}")
                for i in range(16)]
    for busy in (False, True):
        with spinning(busy):
            started = time.perf_counter()
            tokens = sum(len(o.token_ids) for o in backend.generate(requests))
            elapsed = time.perf_counter() - started
        out[f"generate_tok_s_{'busy' if busy else 'idle'}"] = round(tokens / elapsed, 1)
    return out


def load_each(backend: Any, dirs: list[Path]) -> list[float]:
    """Milliseconds of each version's ``add_adapter`` (then ``retain`` of it alone), checking what is served."""
    from loraflow.rollout_worker.adapters import WEIGHTS_FILE, ReceivedAdapter, tensors_sha256

    times = []
    for version, path in enumerate(dirs, 1):
        weights = path / WEIGHTS_FILE
        adapter = ReceivedAdapter(version=version, sha256=tensors_sha256(weights), path=path,
                                  config=json.loads((path / "adapter_config.json").read_text()),
                                  num_bytes=weights.stat().st_size, received_unix=time.time())
        started = time.perf_counter()
        backend.add_adapter(adapter)
        times.append((time.perf_counter() - started) * 1000)
        backend.retain({version})
        if backend.served(version).sha256 != adapter.sha256:
            raise SystemExit(f"v{version}: the backend holds other weights than the file's")
    return times


@contextlib.contextmanager
def spinning(busy: bool) -> Iterator[None]:
    """With ``busy``, a thread spinning in Python meanwhile (as a worker's session thread has Python work to do
    while an adapter arrives, competing for the GIL)."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, daemon=True)
    if busy:
        spinner.start()
    try:
        yield
    finally:
        stop.set()
        if busy:
            spinner.join()


def _header(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(int.from_bytes(f.read(8), "little"))


def main() -> None:
    parser = harness.flags(harness.parser(__doc__), {
        "layers": (28, "decoder layers (14 LoRA tensors each)"), "reference_tree": ("", "another checkout to "
        "measure in the same run"), "swaps": (6, "versions loaded per phase (the first 2 create slots)"),
        "generate_tokens": (16, "tokens per sample of the generation part")})
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the engine's dtype")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "WORK"), help=argparse.SUPPRESS)
    args = harness.parse(parser, None, layers=2, swaps=3, generate_tokens=4)
    if args.child:  # one measurement with the code on sys.path (the reference tree's), as JSON
        model, work = Path(args.child[0]), Path(args.child[1])
        print(json.dumps(measure(model, sorted(work.glob("v*"), key=lambda p: int(p.name[1:])), args.dtype,
                                 args.generate_tokens)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model, dirs = build(Path(tmp), args.layers, max(args.swaps, 3))
        trees = {"this tree": REPO}
        if args.reference_tree:
            trees["reference tree"] = Path(args.reference_tree).resolve()
        argv = [str(Path(__file__).resolve()), "--dtype", args.dtype, "--generate-tokens", str(args.generate_tokens),
                "--child", str(model), tmp]
        results = {name: harness.in_tree(argv, tree, cwd=tree, timeout_s=None) for name, tree in trees.items()}
    for name, r in results.items():
        print(f"{name}: {r['num_tensors']} tensors ({args.dtype} engine): load {r['idle']['median_ms']} ms alone "
              f"(max {r['idle']['max_ms']}), {r['busy']['median_ms']} ms beside a busy thread "
              f"(max {r['busy']['max_ms']})")
        for phase in ("idle", "busy"):
            if r[phase]["phases_ms"]:
                print(f"    {phase} phases of the last load (ms): {r[phase]['phases_ms']}")
        print(f"    generation, 16 samples x {args.generate_tokens} tokens: {r['generate_tok_s_idle']} tokens/s alone, "
              f"{r['generate_tok_s_busy']} beside the busy thread")
    mine = results["this tree"]
    extra = {"reference_tree": results["reference tree"]} if "reference tree" in results else {}
    report("adapter_load", "hf load with a busy thread", mine["busy"]["median_ms"], "ms", mine["idle"]["median_ms"],
           num_tensors=mine["num_tensors"], dtype=args.dtype, phases_ms=mine["busy"]["phases_ms"],
           generate_tok_s_idle=mine["generate_tok_s_idle"], generate_tok_s_busy=mine["generate_tok_s_busy"], **extra)


if __name__ == "__main__":
    main()
