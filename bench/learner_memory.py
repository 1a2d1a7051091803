"""Learner memory at real model shapes: peak RSS per rank against the model's bytes per rank, before / after.

Qwen2-0.5B- and Qwen2-1.5B-shaped models with random weights (real vocabulary size 151,936, tied head, a qwen2
tokenizer from loraflow.common.model_zoo, so the padded vocabulary and the multi-id EOS are those of the releases) are
written offline, one safetensors shard per decoder layer, drawn directly in the target dtype (no fp32 copy of
the model is ever held). Each case runs in fresh processes (1 rank, and 2 ranks under torchrun with gloo, one
torch thread each) that build the policy and train one step on ``--tokens`` tokens per rank (LoRA r=16 on all
linear layers, AdamW), then report ``ru_maxrss``:

- ``after``  = ``loraflow.learner.model.build_policy`` (meta-device build, rank 0 reads one layer at a time and
  broadcasts; base stored in bf16) and ``Policy.trained_logprobs`` (head on the trained positions, chunked);
- ``before`` = :func:`legacy_build`, the previous commit's build (``from_pretrained`` in fp32 on every rank,
  ``get_peft_model``, ``fully_shard``) with its full-logits step (``[B, L, V]`` logits, ``token_logprobs`` and
  ``token_entropy`` on them), kept here as a small function so both run in one bench.

"Model bytes per rank" = this rank's shards of the base (bf16) and of the LoRA parameters, their gradients and
AdamW's two moments (fp32), measured from the tensors. The children run with ``MALLOC_MMAP_THRESHOLD_=262144``
(both code paths): glibc otherwise raises its mmap threshold to 32 MB after the first large free, and the
per-layer all-gather buffers FSDP2 frees are then kept on the heap, so RSS counts freed memory (seen: +770 MB
after one no-grad forward of the 0.5B shape, +270 MB with the fixed threshold, which is the root group kept
gathered). Set it for a learner on CPU too. ``idle`` is the RSS of the same process after imports and
the process group, before the model: the interpreter, torch and transformers, paid whatever the model.

The logits path alone (``--logits``): one micro-batch of ``T`` trained tokens, hidden 896, V = 151,936, bf16
hidden states and head, forward + backward + entropy, peak RSS above the inputs. ``after`` at T = 8,192;
``before`` at T = 512 / 1,024 / 2,048 (it grows linearly in T; 8,192 tokens would need ~25 GB, more than this
shared machine has) and extrapolated linearly to 8,192, marked as such.

Each rank also reports a memory timeline (``phases``: RSS and peak RSS after imports, build, forward, backward,
AdamW), to tell where the peak happens.

The long-row case (``--long-row TOKENS``, alone): one sample of TOKENS tokens on the 0.5B layer shape (2 layers,
bf16, checkpointing on) through ``loraflow.learner.step.forward_backward``, once with a budget above its length (one
row) and once with ``--budget`` (segments, :mod:`loraflow.learner.segments`): peak RSS above the built policy; value =
the split run's, reference = the unsplit run's.

Last line: value = peak RSS per rank (MB) of the 2-rank run of the largest shape run (1.5B unless ``--shapes``
says otherwise), reference = its model bytes per rank (MB), ratio = value / reference; the other figures are
extra keys.

    .venv/bin/python -m bench.learner_memory [--shapes 0.5b,1.5b] [--before-shapes 0.5b] [--tokens 256] [--logits]
    .venv/bin/python -m bench.learner_memory --long-row 8192 [--budget 2048]
    .venv/bin/python -m bench.learner_memory build --shape 1.5b --out DIR [--dtype bfloat16]   (the model only)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import harness

REPO = Path(__file__).resolve().parent.parent
VOCAB = 151_936
SHAPES: dict[str, dict[str, Any]] = {  # from the Qwen2 releases' config.json
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2},
    "0.5b-2l": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 2, "num_attention_heads": 14,
                "num_key_value_heads": 2},  # the long-row case: the 0.5B layer, 2 of them
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1},
}
LAYER = re.compile(r"\.layers\.(\d+)\.")
MB = 1 << 20


# -- the model, offline --------------------------------------------------------------------------------------


def build_shaped_model(directory: Path, shape: str, *, dtype: str = "bfloat16", seed: int = 0,
                       vocab_size: int = VOCAB) -> Path:
    """A Qwen2-family model directory of ``shape`` with random weights in ``dtype``, written a layer at a time."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from loraflow.common import model_zoo

    directory.mkdir(parents=True, exist_ok=True)
    family = model_zoo.FAMILIES["qwen2"]
    tokenizer = model_zoo.build_tokenizer(family, directory, seed=seed)
    small = model_zoo.model_config(family, tokenizer)  # the family's ids (multi-id eos) and settings
    config = AutoConfig.for_model(family.model_type, **SHAPES[shape], vocab_size=vocab_size,
                                  max_position_embeddings=32768, bos_token_id=small.bos_token_id,
                                  eos_token_id=small.eos_token_id, pad_token_id=small.pad_token_id,
                                  **family.config, torch_dtype=dtype)
    config.save_pretrained(str(directory))
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                     eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in family.generation_eos]
                     ).save_pretrained(str(directory))
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    groups: dict[str, dict[str, Any]] = {}
    for name, param in meta.named_parameters():  # a tied head is the embedding: saved once, as releases do
        match = LAYER.search(name)
        groups.setdefault(f"layer{int(match.group(1)):03d}" if match else "rest", {})[name] = param
    device = "cuda" if torch.cuda.is_available() else "cpu"  # drawing 1.5 B values takes minutes on a few cores
    generator = torch.Generator(device).manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    weight_map: dict[str, str] = {}
    total = 0
    for group, params in sorted(groups.items()):
        tensors = {}
        for name, param in params.items():
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(param.shape, dtype=torch_dtype)
            elif name.endswith(".bias"):
                tensors[name] = torch.zeros(param.shape, dtype=torch_dtype)
            else:
                tensors[name] = torch.empty(param.shape, dtype=torch_dtype, device=device).normal_(
                    0, 0.02, generator=generator).cpu()
        file = f"model-{group}.safetensors"
        save_file(tensors, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return directory


# -- the child processes: one rank each ----------------------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MB


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def legacy_build(model_dir: Path, learner: Any, parallel: Any, *, seed: int) -> Any:
    """The learner's model set-up before the meta-device build: every rank loads the whole base in fp32."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from loraflow.learner.model import decoder_layers, lora_config_for, resolve_compute_dtype, shard

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    base.config.use_cache = False
    base.requires_grad_(False)
    layers = decoder_layers(base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(base, lora_config_for(learner, model_dir, ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                           "gate_proj", "up_proj", "down_proj"]))
    model.to(parallel.device)
    shard(model, layers, parallel, resolve_compute_dtype(learner.mixed_precision, parallel.device))
    return model


def _local_bytes(tensor: Any) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def run_rank(args: argparse.Namespace) -> None:
    """One rank: build (after or before), one step on ``args.tokens`` tokens, print this rank's figures."""
    import torch

    from loraflow.common.config import load_config
    from loraflow.common.logprobs import token_entropy, token_logprobs
    from loraflow.learner.model import build_policy
    from loraflow.learner.parallel import init_parallel
    from loraflow.learner.vocab import vocab_rows_of

    torch.set_num_threads(1)
    parallel = init_parallel("cpu")
    config = load_config(None, ["learner.lora_rank=16", 'learner.target_modules="all-linear"',
                                'learner.mixed_precision="bf16"', "learner.activation_checkpointing=\"on\""])
    idle = rss_mb()
    model_dir = Path(args.model_dir)
    if args.mode == "after":
        policy = build_policy(model_dir, config.learner, parallel, seed=0)
        model = policy.model
    else:
        model = legacy_build(model_dir, config.learner, parallel, seed=0)
    built, built_peak = rss_mb(), peak_mb()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    generator = torch.Generator().manual_seed(parallel.rank)
    x = torch.randint(0, 600, (1, args.tokens), generator=generator)
    select = torch.zeros(1, args.tokens, dtype=torch.bool)
    select[:, args.tokens // 4:] = True  # the completion: three quarters of the row
    targets = torch.randint(0, 600, (int(select.sum()),), generator=generator)
    phases = {"idle": [round(idle, 1), round(idle, 1)], "built": [round(built, 1), round(built_peak, 1)]}

    def phase(name: str) -> None:
        phases[name] = [round(rss_mb(), 1), round(peak_mb(), 1)]

    if args.mode == "after":
        logp, _ = policy.trained_logprobs(x, select, targets)
    else:
        logits = model(input_ids=x, use_cache=False).logits[select]
        logp = token_logprobs(logits, targets)
        with torch.no_grad():
            token_entropy(logits.detach())
    phase("forward")
    (-logp.mean()).backward()
    phase("backward")
    optimizer.step()
    phase("optimizer")
    state_bytes = sum(_local_bytes(t) for s in optimizer.state.values() for t in s.values() if t.dim())
    model_bytes = (sum(_local_bytes(p) for p in model.parameters()) + state_bytes
                   + sum(_local_bytes(p.grad) for p in params if p.grad is not None)
                   + sum(rows.num_bytes for rows in vocab_rows_of(model)))  # the embedding / head rows
    result = {"rank": parallel.rank, "world_size": parallel.world_size, "idle_mb": round(idle, 1),
              "built_mb": round(built, 1), "built_peak_mb": round(built_peak, 1), "peak_mb": round(peak_mb(), 1), "model_mb": round(model_bytes / MB, 1),
              "phases": phases}
    print("RESULT " + json.dumps(result), flush=True)
    parallel.barrier()
    parallel.close()


def run_long_row(args: argparse.Namespace) -> None:
    """One sample of ``args.tokens`` tokens (a quarter prompt) through ``loraflow.learner.step.forward_backward`` at the
    token budget ``args.budget`` (a row longer than it runs in segments): peak RSS above the built policy."""
    import time

    import torch

    from loraflow.common.config import load_config
    from loraflow.learner import data
    from loraflow.learner.loss import LossConfig
    from loraflow.learner.model import build_policy
    from loraflow.learner.parallel import init_parallel
    from loraflow.learner.step import forward_backward

    torch.set_num_threads(1)
    parallel = init_parallel("cpu")
    config = load_config(None, ["learner.lora_rank=16", 'learner.target_modules="all-linear"',
                                'learner.mixed_precision="bf16"', 'learner.activation_checkpointing="on"',
                                f"learner.micro_batch_tokens={args.budget}"])
    policy = build_policy(Path(args.model_dir), config.learner, parallel, seed=0)
    generator = torch.Generator().manual_seed(0)
    prompt, completion = args.tokens // 4, args.tokens + 1 - args.tokens // 4
    sample = data.Sample(group=0, tokens=torch.randint(0, 600, (prompt + completion,), generator=generator),
                         prompt_len=prompt, behaviour_logp=torch.full((completion,), -6.0),
                         loss_mask=torch.ones(completion, dtype=torch.bool))
    other = data.Sample(group=0, tokens=sample.tokens[:prompt + 1], prompt_len=prompt, behaviour_logp=torch.zeros(1),
                        loss_mask=torch.ones(1, dtype=torch.bool))  # a group of two: non-zero advantages
    step = data.StepBatch(batch_id="long", group_ids=["0"], min_versions=[0], samples=[sample, other],
                          rewards=torch.tensor([1.0, 0.0]), group_index=torch.zeros(2, dtype=torch.int64))
    built = rss_mb()
    started = time.monotonic()
    forward_backward(policy, step, parallel=parallel, config=config,
                     loss_config=LossConfig.from_learner(config.learner))
    seconds = time.monotonic() - started
    grads = [p.grad for p in policy.trainable_parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g.to_local()).all() for g in grads)
    print("RESULT " + json.dumps({"tokens": args.tokens, "budget": args.budget, "built_mb": round(built, 1),
                                  "peak_above_built_mb": round(peak_mb() - built, 1), "seconds": round(seconds, 1)}),
          flush=True)
    parallel.close()


def run_logits(args: argparse.Namespace) -> None:
    """One micro-batch's head path: peak RSS above the inputs, before (full logits) or after (chunked)."""
    import torch

    from loraflow.common.logprobs import token_entropy, token_logprobs
    from loraflow.learner import head

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    hidden_size, tokens = 896, args.tokens
    weight = (torch.randn(VOCAB, hidden_size, generator=g) * 0.02).to(torch.bfloat16)
    leaf = torch.randn(tokens, hidden_size, generator=g).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (tokens,), generator=g)
    start = rss_mb()
    if args.mode == "after":
        logp, entropy = head.trained_logprobs(leaf, weight, targets)
    else:
        logits = leaf @ weight.T
        logp = token_logprobs(logits, targets)
        with torch.no_grad():
            entropy = token_entropy(logits.detach())
    logp.sum().backward()
    assert torch.isfinite(leaf.grad.float()).all() and torch.isfinite(entropy).all()
    print("RESULT " + json.dumps({"tokens": tokens, "peak_above_inputs_mb": round(peak_mb() - start, 1)}),
          flush=True)


# -- the parent: cases, table, JSON line ---------------------------------------------------------------------


def child_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               MALLOC_MMAP_THRESHOLD_=os.environ.get("MALLOC_MMAP_THRESHOLD_", str(256 << 10)))
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def results_of(argv: list[str], timeout_s: float = 3600) -> list[dict[str, Any]]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=child_env(), cwd=REPO)
    lines = [json.loads(x.removeprefix("RESULT ")) for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return lines


def run_case(model_dir: Path, mode: str, ranks: int, tokens: int) -> dict[str, Any]:
    script = [str(Path(__file__).resolve()), "rank", "--mode", mode, "--model-dir", str(model_dir),
              "--tokens", str(tokens)]
    if ranks == 1:
        argv = [sys.executable, *script]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *script]
    per_rank = results_of(argv)
    worst = max(per_rank, key=lambda r: r["peak_mb"])
    return {**worst, "ranks": ranks, "mode": mode, "peak_ranks_mb": [r["peak_mb"] for r in per_rank]}


def long_rows(args: argparse.Namespace) -> None:
    """One sample of ``--long-row`` tokens, unsplit (budget = its length) and in segments of ``--budget``."""
    from bench.report import report

    with tempfile.TemporaryDirectory(prefix="bench-learner-long-row-", dir=args.work_dir or None) as tmp:
        model_dir = build_shaped_model(Path(tmp) / "0.5b-2l", "0.5b-2l")
        runs = [results_of([sys.executable, str(Path(__file__).resolve()), "long-row", "--model-dir", str(model_dir),
                            "--tokens", str(args.long_row), "--budget", str(budget)])[0]
                for budget in (args.long_row, args.budget)]
    whole, split = runs
    print(f"\none sample of {args.long_row} tokens, 0.5B layer shape x 2 layers, bf16, checkpointing on, "
          "forward + backward: peak RSS above the built policy")
    for name, r in (("unsplit", whole), (f"segments of {args.budget}", split)):
        print(f"  {name:>20}: {r['peak_above_built_mb']:>8.0f} MB  ({r['peak_above_built_mb'] * 1024 / args.long_row:.1f}"
              f" KiB/token)  {r['seconds']:.1f} s")
    report("learner_memory", f"long_row_{args.long_row}_peak_above_built", split["peak_above_built_mb"], "MB",
           whole["peak_above_built_mb"], budget=args.budget, unsplit_s=whole["seconds"], split_s=split["seconds"])


def main() -> None:
    parser = harness.parser(__doc__)
    sub = parser.add_subparsers(dest="command")
    build = sub.add_parser("build", help="write a shaped random model directory and exit")
    build.add_argument("--shape", choices=sorted(SHAPES), required=True)
    build.add_argument("--out", required=True)
    build.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    build.add_argument("--vocab-size", type=int, default=VOCAB)
    rank = sub.add_parser("rank", help="(internal) one rank of a case")
    rank.add_argument("--mode", choices=("before", "after"), required=True)
    rank.add_argument("--model-dir", required=True)
    rank.add_argument("--tokens", type=int, required=True)
    logits = sub.add_parser("logits", help="(internal) the head path of one micro-batch")
    logits.add_argument("--mode", choices=("before", "after"), required=True)
    logits.add_argument("--tokens", type=int, required=True)
    long_row = sub.add_parser("long-row", help="(internal) one long sample at a token budget")
    long_row.add_argument("--model-dir", required=True)
    long_row.add_argument("--tokens", type=int, required=True)
    long_row.add_argument("--budget", type=int, required=True)
    parser.add_argument("--long-row", type=int, default=0, metavar="TOKENS",
                        help="only this: one sample of TOKENS tokens on the 0.5B layer shape (2 layers), unsplit "
                             "and in segments of --budget tokens")
    parser.add_argument("--budget", type=int, default=2048, help="the token budget of the --long-row split run")
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--before-shapes", default="0.5b", help="shapes to run the old code path on too "
                        "(it holds the fp32 base per rank: 1.5b x 2 ranks needs ~14 GB)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per rank in the measured step")
    parser.add_argument("--logits", action="store_true", help="also measure the head path alone")
    parser.add_argument("--work-dir", default="", help="keep the model directories here (default: a temp dir)")
    args = harness.parse(parser, None, shapes="tiny", before_shapes="", tokens=32)
    if args.command == "build":
        print(build_shaped_model(Path(args.out), args.shape, dtype=args.dtype, vocab_size=args.vocab_size))
        return
    if args.command == "rank":
        run_rank(args)
        return
    if args.command == "logits":
        run_logits(args)
        return
    if args.command == "long-row":
        run_long_row(args)
        return
    if args.long_row:
        long_rows(args)
        return
    shapes = [s for s in args.shapes.split(",") if s]
    before_shapes = {s for s in args.before_shapes.split(",") if s}
    extra: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-learner-memory-", dir=args.work_dir or None) as tmp:
        for shape in shapes:
            model_dir = build_shaped_model(Path(tmp) / shape, shape)
            for mode in (("before", "after") if shape in before_shapes else ("after",)):
                for ranks in (1, 2):
                    row = {"shape": shape, **run_case(model_dir, mode, ranks, args.tokens)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\npeak RSS per rank (MB) after building the policy and one step of {args.tokens} tokens per rank; "
          "model = this rank's base shards (bf16) + LoRA, grads, AdamW (fp32)")
    print(f"{'shape':>5} {'code':>6} {'ranks':>5} {'idle':>7} {'built':>8} {'peak':>8} {'model':>8} "
          f"{'peak/model':>10} {'(peak-idle)/model':>17}")
    for r in rows:
        print(f"{r['shape']:>5} {r['mode']:>6} {r['ranks']:>5} {r['idle_mb']:>7.0f} {r['built_mb']:>8.0f} "
              f"{r['peak_mb']:>8.0f} {r['model_mb']:>8.0f} {r['peak_mb'] / r['model_mb']:>10.2f} "
              f"{(r['peak_mb'] - r['idle_mb']) / r['model_mb']:>17.2f}")
        key = f"{r['shape'].replace('.', '_')}_{r['mode']}_r{r['ranks']}"
        extra[f"{key}_peak_mb"] = r["peak_mb"]
        extra[f"{key}_model_mb"] = r["model_mb"]
        extra[f"{key}_idle_mb"] = r["idle_mb"]
    if args.logits:
        after = results_of([sys.executable, str(Path(__file__).resolve()), "logits", "--mode", "after",
                            "--tokens", "8192"])[0]
        before = [results_of([sys.executable, str(Path(__file__).resolve()), "logits", "--mode", "before",
                              "--tokens", str(t)])[0] for t in (512, 1024, 2048)]
        per_token = (before[-1]["peak_above_inputs_mb"] - before[0]["peak_above_inputs_mb"]) / (2048 - 512)
        extrapolated = before[-1]["peak_above_inputs_mb"] + per_token * (8192 - 2048)
        print(f"\nhead path of one micro-batch, V = {VOCAB}, hidden 896, bf16 (peak RSS above the inputs, MB)")
        for b in before:
            print(f"  before (full logits)  T = {b['tokens']:>5}: {b['peak_above_inputs_mb']:>8.0f}")
        print(f"  before (full logits)  T =  8192: {extrapolated:>8.0f}  (extrapolated, {per_token:.2f} MB/token)")
        print(f"  after  (chunked)      T =  8192: {after['peak_above_inputs_mb']:>8.0f}  (measured)")
        extra.update(logits_after_8192_mb=after["peak_above_inputs_mb"], logits_before_8192_mb_extrapolated=round(
            extrapolated, 1), logits_before_mb={str(b["tokens"]): b["peak_above_inputs_mb"] for b in before})
    from bench.report import report

    main_row = next(r for r in reversed(rows) if r["mode"] == "after" and r["ranks"] == 2)
    report("learner_memory", f"peak_rss_per_rank_2_ranks_{main_row['shape']}", main_row["peak_mb"], "MB",
           main_row["model_mb"], tokens_per_rank=args.tokens, **extra)


if __name__ == "__main__":
    main()
