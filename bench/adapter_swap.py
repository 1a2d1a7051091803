"""Adapter hot-swap on a worker: time from an adapter update arriving to the first token generated with it,
against the time of one decode step; and bytes moved per sync against the size of the full model.

    .venv/bin/python -m bench.adapter_swap [--swaps 6] [--batch 8] [--backends hf,vllm]

Swap latency, for the hf and vllm backends on the tiny model (rank-16 LoRA on all projections, fp32): the clock
starts when the AdapterUpdate's frames are in hand (as the worker's session receives them from zmq) and stops when
the backend has generated one token with the new version for a batch of ``--batch`` prompts. In between: decode
and checksum the message, write the PEFT directory (:class:`loraflow.rollout_worker.adapters.AdapterStore`), load it into
the running backend (a peft slot / a new vLLM LoRARequest; old versions retained as the worker does: 3 resident),
prefill + first decode step under the new version. The reference is one decode step of the same batch under the
previous version: (time for 33 tokens - time for 1 token) / 32, measured in the same run. The first adapter ever
loaded (hf injects the LoRA layers then) and the swaps that still create a slot (until 3 + 1 exist) are reported
separately; the figure is the median of the later swaps, which reuse freed slots as a long run does.

Bytes per sync: a rank-16 LoRA on every projection of a Qwen2-0.5B-shaped model (random init on the meta device:
no weights are downloaded or even allocated for the base) is encoded as the real AdapterUpdate message in bf16;
its size is compared to the bf16 size of the full model, which a full-weight sync would move.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench import harness
from bench.report import report, scratch_dir

LORA_RANK = 16
RESIDENT = 3


def swap_latency(name: str, model_dir: Path, updates: list, batch: int) -> dict[str, float]:  # noqa: ANN001
    """Per-swap timings (ms) of one backend; ``updates`` are (version, frames) pairs as received."""
    from bench.harness import codec
    from loraflow.rollout_worker.adapters import AdapterStore
    from loraflow.rollout_worker.backends.base import GenRequest

    backend = harness.tiny_backend(name, model_dir, **(dict(max_loras=RESIDENT, max_lora_rank=LORA_RANK,
                                   max_model_len=512, max_num_seqs=64) if name == "vllm" else {}))
    store = AdapterStore(scratch_dir(prefix=f"bench-swap-{name}-"))
    prompts = [backend.encode(f"{10 + i}+{20 + i}=") for i in range(batch)]

    def generate(version: int, tokens: int) -> float:
        started = time.perf_counter()
        backend.generate([GenRequest(token_ids=p, max_tokens=tokens, version=version) for p in prompts], greedy=True)
        return time.perf_counter() - started

    generate(0, 4)  # warm-up
    rows = []
    for version, frames in updates:
        decode_steps = [(generate(backend.newest_version, 33) - generate(backend.newest_version, 1)) / 32
                        for _ in range(3)]
        started = time.perf_counter()
        record, envelope = codec.decode(frames)
        adapter = store.receive(record, envelope.specs, envelope.frames)
        received = time.perf_counter()
        backend.add_adapter(adapter)
        keep = set(sorted(backend.adapters)[-RESIDENT:])
        backend.retain(keep)
        store.prune(keep, upto_version=version)
        loaded = time.perf_counter()
        generate(version, 1)
        done = time.perf_counter()
        rows.append({"receive_ms": (received - started) * 1e3, "load_ms": (loaded - received) * 1e3,
                     "first_token_ms": (done - loaded) * 1e3, "total_ms": (done - started) * 1e3,
                     "decode_step_ms": statistics.median(decode_steps) * 1e3})
    backend.close()
    # the first adapter (hf injects LoRA layers), then new slots until RESIDENT + 1 exist, then reused slots
    steady = rows[RESIDENT + 1:]
    result = {f"first_{k}": v for k, v in rows[0].items()}
    result.update({f"new_slot_{k}": statistics.median(r[k] for r in rows[1:RESIDENT + 1]) for k in rows[0]})
    result.update({k: statistics.median(r[k] for r in steady) for k in rows[0]})
    return result


def sync_bytes_for_a_05b_model() -> dict[str, float]:
    """Bytes of one AdapterUpdate (rank 16, all projections, bf16) for a Qwen2-0.5B-shaped model vs the model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    from bench.harness import codec
    from loraflow.common.framing import frames_sha256
    from loraflow.common.protocol import AdapterUpdate

    config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    num_params = sum(p.numel() for p in model.parameters())
    lora = LoraConfig(r=LORA_RANK, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(model, lora)
    tensors = [(name.replace(".default", ""), torch.randn(p.shape, dtype=torch.bfloat16))
               for name, p in peft_model.named_parameters() if "lora_" in name]
    frames = codec.encode(AdapterUpdate(version=1, sha256="0" * 64, adapter_config={}), tensors)
    update = AdapterUpdate(version=1, sha256=frames_sha256(frames[2:]), adapter_config=lora.to_dict() | {
        "target_modules": sorted(lora.target_modules), "peft_type": "LORA", "task_type": None})
    frames = codec.encode(update, tensors)
    sync_bytes = sum(memoryview(f).nbytes for f in frames)
    started = time.perf_counter()
    record, envelope = codec.decode([bytes(f) for f in frames])
    from loraflow.rollout_worker.adapters import AdapterStore

    AdapterStore(scratch_dir(prefix="bench-swap-05b-")).receive(record, envelope.specs, envelope.frames)
    receive_ms = (time.perf_counter() - started) * 1e3
    return {"sync_bytes": sync_bytes, "model_bytes": model_bytes, "model_params": num_params,
            "lora_params": sum(t.numel() for _, t in tensors), "receive_ms": receive_ms}


def main() -> None:
    parser = harness.flags(harness.parser(__doc__), {"swaps": 12, "batch": 8, "backends": "hf,vllm"})
    args = harness.parse(parser, None, swaps=RESIDENT + 3, batch=2, backends="hf")
    if args.swaps < RESIDENT + 3:
        parser.error(f"--swaps must be >= {RESIDENT + 3} (the figure is the median once slots are reused)")

    import torch

    torch.set_num_threads(1)
    from loraflow.common.tiny_model import resolve_model
    from tests.worker.helpers import make_adapter

    model_dir = resolve_model("builtin:tiny")
    updates = [(v, [bytes(f) for f in make_adapter(model_dir, v, seed=v, rank=LORA_RANK).frames])
               for v in range(1, args.swaps + 2)]
    results = {}
    for name in args.backends.split(","):
        r = results[name] = swap_latency(name, model_dir, updates, args.batch)
        print(f"{name:5s} swap -> first token {r['total_ms']:7.1f} ms (receive {r['receive_ms']:.1f}, load "
              f"{r['load_ms']:.1f}, prefill + 1 token {r['first_token_ms']:.1f}) vs one decode step "
              f"{r['decode_step_ms']:.1f} ms = {r['total_ms'] / r['decode_step_ms']:.1f} steps; first adapter "
              f"{r['first_total_ms']:.1f} ms, new slot {r['new_slot_total_ms']:.1f} ms", flush=True)
    sync = sync_bytes_for_a_05b_model()
    ratio = sync["sync_bytes"] / sync["model_bytes"]
    print(f"Qwen2-0.5B-shaped ({sync['model_params'] / 1e6:.0f} M params), LoRA r={LORA_RANK} on all projections "
          f"({sync['lora_params'] / 1e6:.2f} M params), bf16: {sync['sync_bytes'] / 2**20:.1f} MiB per sync vs "
          f"{sync['model_bytes'] / 2**20:.0f} MiB full model = {ratio:.2%}; verify + write on the worker "
          f"{sync['receive_ms']:.0f} ms")
    main_name = "hf" if "hf" in results else next(iter(results))
    main = results[main_name]
    report("adapter_swap", f"{main_name}_swap_to_first_token_ms", main["total_ms"], "ms", main["decode_step_ms"],
           **{f"{n}_{k}": round(v, 2) for n, r in results.items() for k, v in r.items()},
           sync_bytes=sync["sync_bytes"], full_model_bytes=sync["model_bytes"], sync_ratio=round(ratio, 5),
           batch=args.batch, lora_rank=LORA_RANK)


if __name__ == "__main__":
    main()
