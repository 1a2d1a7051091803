"""Weight sync: bytes per adapter version, and time from the optimizer step to the adapter being at the broker.

One learner process (a process group of one, FSDP2 on the CPU) trains the LoRA adapter on small synthetic
batches and, after each optimizer step, publishes the new version exactly as the learner does: gather the
LoRA tensors in one collective (``loraflow.learner.publish.gather_trainable``), PEFT names,
sha256, AdapterUpdate through a real broker (``python -m loraflow.broker``), until the broker's Ack (the adapter is then
available to every worker). Timed from the end of ``optimizer.step()`` to that Ack.

Reference, same run: the full model's weights (every tensor of its state dict): their size, and a plain
``safetensors.save_file`` of them to local disk, the least a sync that moved the whole model would cost before
any network.

Last line: value = median ms from step to adapter available, reference = median ms of the full save; the
bytes of both are in the extra fields.

    .venv/bin/python -m bench.weight_sync [--versions 20] [--rank 16] [--hidden 128 --layers 4 --intermediate 512]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench import harness
from bench.harness import RUN_TOKEN, report
from loraflow.common.config import load_config
from loraflow.common.metrics import Metrics
from loraflow.common.tiny_model import TinyShape, build_tiny_model, resolve_model
from loraflow.learner import data, publish
from loraflow.learner.loss import LossConfig
from loraflow.learner.model import build_policy
from loraflow.learner.parallel import init_parallel
from loraflow.learner.session import BrokerSession
from loraflow.learner.step import make_optimizer, train_step
from tests.learner.scripted import make_batch
from tests.support import Processes, start_broker


def model_dir_for(args: argparse.Namespace, tmp: Path) -> Path:
    shape = TinyShape(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=max(1, args.hidden // 32), num_key_value_heads=max(1, args.hidden // 64))
    if shape == TinyShape():
        return resolve_model("builtin:tiny")
    return build_tiny_model(tmp / "model", shape=shape)


def full_save_ms(model_dir: Path, tmp: Path, repeats: int) -> tuple[float, int]:
    """Median ms of save_file() of the full model's weights, and their bytes."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).state_dict()
    state = {k: v.contiguous() for k, v in state.items()}
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    path, times = tmp / "full.safetensors", []
    for _ in range(repeats):
        started = time.perf_counter()
        save_file(state, str(path))
        times.append(1000 * (time.perf_counter() - started))
        path.unlink()
    return statistics.median(times), num_bytes


def main() -> None:
    parser = harness.flags(harness.parser(__doc__), {"versions": 20, "rank": (16, "LoRA rank (all 7 projections)"),
                                                     "hidden": 128, "layers": 4, "intermediate": 512})
    args = harness.parse(parser, None, versions=3)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir, procs, parallel, session = model_dir_for(args, tmp), Processes(tmp), init_parallel("cpu"), None
        try:
            # its own broker with a known run token (bench/broker_proc.py's): nothing outside the temp dir is read
            token = f'security.run_token="{RUN_TOKEN}"'
            broker = start_broker(procs, f"model.path=\"{model_dir}\"", "run.groups_per_step=2", "run.group_size=4",
                                  token, run_dir=tmp / "run")
            config = load_config(None, [f"broker.endpoint=\"{broker.endpoint}\"", token, f'run.run_dir="{tmp / "run"}"',
                                        f"learner.lora_rank={args.rank}",
                                        f"learner.lora_alpha={2 * args.rank}", "learner.micro_batch_tokens=4096"])
            policy = build_policy(model_dir, config.learner, parallel, seed=0)
            optimizer, scheduler = make_optimizer(policy, config.learner)
            session = BrokerSession(config, version=0, metrics=Metrics())
            session.start(30)
            sync_ms, gather_ms, num_bytes = [], [], 0
            for version in range(1, args.versions + 1):
                batch = data.decode_step_batch(make_batch(0, version, num_groups=2, group_size=4))
                train_step(policy, optimizer, scheduler, batch, parallel=parallel, config=config,
                           loss_config=LossConfig())
                stepped = time.perf_counter()  # train_step returns right after optimizer.step()
                snap = publish.snapshot(policy, version=version, step=version, is_main=True)
                gathered = time.perf_counter()
                session.publish(snap)
                if not session.drain(30):
                    raise SystemExit(f"the broker did not acknowledge adapter version {version} within 30 s")
                sync_ms.append(1000 * (time.perf_counter() - stepped))
                session.adapter_acks.clear()
                gather_ms.append(1000 * (gathered - stepped))
                num_bytes = snap.num_bytes
            save_ms, full_bytes = full_save_ms(model_dir, tmp, repeats=5)
        finally:
            if session is not None:
                session.close("done")
            parallel.close()
            procs.cleanup()
    sync, gather = statistics.median(sync_ms[1:]), statistics.median(gather_ms[1:])
    print(f"model hidden {args.hidden}, {args.layers} layers: full weights {full_bytes / 1e6:.2f} MB; "
          f"LoRA r={args.rank} adapter {num_bytes / 1e6:.3f} MB ({full_bytes / num_bytes:.1f}x smaller)")
    print(f"step -> adapter at broker: median {sync:.1f} ms (gather + names + sha256 {gather:.1f} ms, "
          f"send + broker + ack {sync - gather:.1f} ms) over {len(sync_ms) - 1} versions")
    print(f"plain save of the full weights: median {save_ms:.1f} ms  (cpus: {os.cpu_count()})")
    report("weight_sync", "step_to_adapter_available_ms", sync, "ms", save_ms, adapter_bytes=num_bytes,
           full_model_bytes=full_bytes, bytes_ratio=round(num_bytes / full_bytes, 5), gather_ms=round(gather, 3),
           hidden=args.hidden, layers=args.layers, lora_rank=args.rank)


if __name__ == "__main__":
    main()
