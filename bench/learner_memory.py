"""Learner memory at real model shapes: peak RSS per rank against the model's bytes per rank, before / after.

Qwen2-0.5B- and 1.5B-shaped models with random weights (the releases' vocabulary of 151,936, tied head and
multi-id EOS, by loraflow.common.model_zoo) are written offline a decoder layer per safetensors shard. Each case
runs in fresh processes (1 rank; 2 under torchrun, gloo, one torch thread each) that build the policy and train
one step on ``--tokens`` tokens per rank (LoRA r=16 on all linear layers, AdamW). ``after`` is
``loraflow.learner.model.build_policy`` with ``Policy.trained_logprobs``; ``before`` is :func:`legacy_build`
(fp32 ``from_pretrained`` on every rank) with full ``[B, L, V]`` logits. *model* = this rank's base shards (bf16),
LoRA parameters, gradients and AdamW moments (fp32), from the tensors; *idle* = the process before the model;
``phases`` = RSS and peak after each of build, forward, backward, AdamW. Children run with
``MALLOC_MMAP_THRESHOLD_=262144``, or glibc keeps the all-gather buffers FSDP2 frees and RSS counts them.

``--logits``: the head path of one micro-batch alone (hidden 896, bf16), peak RSS above the inputs: ``after`` at
T = 8,192, ``before`` at 512 / 1,024 / 2,048 extrapolated linearly to 8,192 (measured it would need ~25 GB).
``--long-row TOKENS`` (alone): one sample on two 0.5B layers through ``loraflow.learner.step.forward_backward``,
unsplit and in segments of ``--budget``: value = the split run's peak above the built policy, reference = the
unsplit run's. Otherwise value = peak RSS per rank (MB) of the last shape's 2-rank ``after`` run, reference = its
model bytes per rank.

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
from bench.report import checkout_env
from loraflow.common.cli import one_host_torchrun

VOCAB = 151_936
#: hidden, intermediate, layers, attention heads, key/value heads: the Qwen2 releases' config.json, the 0.5B
#: layer twice (the long-row case) and a tiny one (--quick)
SHAPES: dict[str, dict[str, int]] = {
    name: dict(zip(("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads"), sizes, strict=True))
    for name, sizes in {"0.5b": (896, 4864, 24, 14, 2), "1.5b": (1536, 8960, 28, 12, 2),
                        "0.5b-2l": (896, 4864, 2, 14, 2), "tiny": (128, 256, 2, 2, 1)}.items()}
LAYER = re.compile(r"\.layers\.(\d+)\.")
MB = 1 << 20
#: the flags and their defaults (``--quick``: the tiny shape, 32 tokens, no before run)
FLAGS = {"shapes": "0.5b,1.5b", "tokens": (256, "tokens per rank in the measured step"),
         "before_shapes": ("0.5b", "shapes to run the old code path on too (it holds the fp32 base per rank: 1.5b "
                                   "x 2 ranks needs ~14 GB)"),
         "long_row": (0, "only this: one sample of N tokens on the 0.5B layer shape (2 layers), unsplit and in "
                         "segments of --budget tokens"),
         "budget": (2048, "the token budget of the --long-row split run"),
         "work_dir": ("", "keep the model directories here (default: a temp dir)")}
LEARNER_SETTINGS = ["learner.lora_rank=16", 'learner.target_modules="all-linear"', 'learner.mixed_precision="bf16"',
                    'learner.activation_checkpointing="on"']


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
    return harness.rss_bytes(os.getpid()) / MB


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def result(**figures: Any) -> None:
    """This child's figures, as the line the parent reads (:func:`child`)."""
    print("RESULT " + json.dumps(figures), flush=True)


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


def local_bytes(tensor: Any) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def run_rank(*, mode: str, model_dir: str, tokens: int) -> None:
    """One rank: build (after or before), one step on ``tokens`` tokens, print this rank's figures."""
    import torch

    from loraflow.common.config import load_config
    from loraflow.common.logprobs import token_entropy, token_logprobs
    from loraflow.learner.model import build_policy
    from loraflow.learner.parallel import init_parallel
    from loraflow.learner.vocab import vocab_rows_of

    torch.set_num_threads(1)
    parallel = init_parallel("cpu")
    config = load_config(None, LEARNER_SETTINGS)
    idle = round(rss_mb(), 1)
    phases = {"idle": [idle, idle]}

    def phase(name: str) -> None:
        phases[name] = [round(rss_mb(), 1), round(peak_mb(), 1)]

    if mode == "after":
        policy = build_policy(Path(model_dir), config.learner, parallel, seed=0)
        model = policy.model
    else:
        model = legacy_build(Path(model_dir), config.learner, parallel, seed=0)
    phase("built")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    generator = torch.Generator().manual_seed(parallel.rank)
    x = torch.randint(0, 600, (1, tokens), generator=generator)
    select = torch.zeros(1, tokens, dtype=torch.bool)
    select[:, tokens // 4:] = True  # the completion: three quarters of the row
    targets = torch.randint(0, 600, (int(select.sum()),), generator=generator)
    if mode == "after":
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
    state_bytes = sum(local_bytes(t) for s in optimizer.state.values() for t in s.values() if t.dim())
    model_bytes = (sum(local_bytes(p) for p in model.parameters()) + state_bytes
                   + sum(local_bytes(p.grad) for p in params if p.grad is not None)
                   + sum(rows.num_bytes for rows in vocab_rows_of(model)))  # the embedding / head rows
    built, built_peak = phases["built"]
    result(rank=parallel.rank, world_size=parallel.world_size, idle_mb=idle, built_mb=built,
           built_peak_mb=built_peak, peak_mb=round(peak_mb(), 1), model_mb=round(model_bytes / MB, 1),
           phases=phases)
    parallel.barrier()
    parallel.close()


def run_long_row(*, model_dir: str, tokens: int, budget: int) -> None:
    """One sample of ``tokens`` tokens (a quarter prompt) through ``forward_backward`` at the token budget
    ``budget`` (a row longer than it runs in segments): peak RSS above the built policy."""
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
    config = load_config(None, [*LEARNER_SETTINGS, f"learner.micro_batch_tokens={budget}"])
    policy = build_policy(Path(model_dir), config.learner, parallel, seed=0)
    generator = torch.Generator().manual_seed(0)
    prompt, completion = tokens // 4, tokens + 1 - tokens // 4
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
    result(tokens=tokens, budget=budget, built_mb=round(built, 1),
           peak_above_built_mb=round(peak_mb() - built, 1), seconds=round(seconds, 1))
    parallel.close()


def run_logits(*, mode: str, tokens: int) -> None:
    """One micro-batch's head path: peak RSS above the inputs, before (full logits) or after (chunked)."""
    import torch

    from loraflow.common.logprobs import token_entropy, token_logprobs
    from loraflow.learner import head

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    hidden_size = 896
    weight = (torch.randn(VOCAB, hidden_size, generator=g) * 0.02).to(torch.bfloat16)
    leaf = torch.randn(tokens, hidden_size, generator=g).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (tokens,), generator=g)
    start = rss_mb()
    if mode == "after":
        logp, entropy = head.trained_logprobs(leaf, weight, targets)
    else:
        logits = leaf @ weight.T
        logp = token_logprobs(logits, targets)
        with torch.no_grad():
            entropy = token_entropy(logits.detach())
    logp.sum().backward()
    assert torch.isfinite(leaf.grad.float()).all() and torch.isfinite(entropy).all()
    result(tokens=tokens, peak_above_inputs_mb=round(peak_mb() - start, 1))


# -- the parent: cases, tables, JSON line --------------------------------------------------------------------


def child(name: str, ranks: int = 1, **params: Any) -> list[dict[str, Any]]:
    """The RESULT lines of ``CHILDREN[name](**params)`` run in a fresh process (torchrun's for more than one rank)."""
    launcher = [] if ranks == 1 else one_host_torchrun(ranks)
    command = [sys.executable, *launcher, str(Path(__file__).resolve()), name, json.dumps(params)]
    env = {**checkout_env(harness.REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1", "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(256 << 10))}
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600, env=env, cwd=harness.REPO)
    lines = [json.loads(x.removeprefix("RESULT ")) for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return lines


def run_case(model_dir: Path, mode: str, ranks: int, tokens: int) -> dict[str, Any]:
    """The rank with the highest peak of one case, and every rank's peak."""
    per_rank = child("rank", ranks, mode=mode, model_dir=str(model_dir), tokens=tokens)
    worst = max(per_rank, key=lambda r: r["peak_mb"])
    return {**worst, "ranks": ranks, "mode": mode, "peak_ranks_mb": [r["peak_mb"] for r in per_rank]}


def long_rows(args: argparse.Namespace) -> None:
    """One sample of ``--long-row`` tokens, unsplit (budget = its length) and in segments of ``--budget``."""
    with tempfile.TemporaryDirectory(prefix="bench-learner-long-row-", dir=args.work_dir or None) as tmp:
        model_dir = build_shaped_model(Path(tmp) / "0.5b-2l", "0.5b-2l")
        whole, split = (child("long-row", model_dir=str(model_dir), tokens=args.long_row, budget=budget)[0]
                        for budget in (args.long_row, args.budget))
    print(f"\none sample of {args.long_row} tokens, 0.5B layer shape x 2 layers, bf16, checkpointing on, "
          "forward + backward: peak RSS above the built policy")
    harness.table(("run", "MB", "KiB/token", "s"),
                  [(name, f"{r['peak_above_built_mb']:.0f}", f"{r['peak_above_built_mb'] * 1024 / args.long_row:.1f}",
                    f"{r['seconds']:.1f}") for name, r in (("unsplit", whole), (f"segments of {args.budget}", split))])
    harness.report("learner_memory", f"long_row_{args.long_row}_peak_above_built", split["peak_above_built_mb"], "MB",
                   whole["peak_above_built_mb"], budget=args.budget, unsplit_s=whole["seconds"],
                   split_s=split["seconds"])


def logits_figures() -> dict[str, Any]:
    """The head path alone: after measured at 8,192 tokens, before at 512..2,048 and extrapolated to 8,192."""
    after = child("logits", mode="after", tokens=8192)[0]
    before = [child("logits", mode="before", tokens=t)[0] for t in (512, 1024, 2048)]
    per_token = (before[-1]["peak_above_inputs_mb"] - before[0]["peak_above_inputs_mb"]) / (2048 - 512)
    extrapolated = before[-1]["peak_above_inputs_mb"] + per_token * (8192 - 2048)
    print(f"\nhead path of one micro-batch, V = {VOCAB}, hidden 896, bf16 (peak RSS above the inputs, MB)")
    harness.table(("code", "T", "MB", ""),
                  [*(("before (full logits)", b["tokens"], f"{b['peak_above_inputs_mb']:.0f}", "measured")
                     for b in before),
                   ("before (full logits)", 8192, f"{extrapolated:.0f}", f"extrapolated, {per_token:.2f} MB/token"),
                   ("after (chunked)", 8192, f"{after['peak_above_inputs_mb']:.0f}", "measured")])
    return {"logits_after_8192_mb": after["peak_above_inputs_mb"],
            "logits_before_8192_mb_extrapolated": round(extrapolated, 1),
            "logits_before_mb": {str(b["tokens"]): b["peak_above_inputs_mb"] for b in before}}


CHILDREN = {"rank": run_rank, "logits": run_logits, "long-row": run_long_row}


def main() -> None:
    if sys.argv[1:2] and sys.argv[1] in CHILDREN:  # a process :func:`child` started
        return CHILDREN[sys.argv[1]](**json.loads(sys.argv[2]))
    parser = harness.parser(__doc__)
    sub = parser.add_subparsers(dest="command")
    build = sub.add_parser("build", help="write a shaped random model directory and exit")
    build.add_argument("--shape", choices=sorted(SHAPES), required=True)
    build.add_argument("--out", required=True)
    build.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    build.add_argument("--vocab-size", type=int, default=VOCAB)
    harness.flags(parser, FLAGS)
    parser.add_argument("--logits", action="store_true", help="also measure the head path alone")
    args = harness.parse(parser, None, shapes="tiny", before_shapes="", tokens=32)
    if args.command == "build":
        print(build_shaped_model(Path(args.out), args.shape, dtype=args.dtype, vocab_size=args.vocab_size))
        return None
    if args.long_row:
        return long_rows(args)
    shapes = [s for s in args.shapes.split(",") if s]
    before_shapes = {s for s in args.before_shapes.split(",") if s}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-learner-memory-", dir=args.work_dir or None) as tmp:
        for shape in shapes:
            model_dir = build_shaped_model(Path(tmp) / shape, shape)
            for mode in (("before", "after") if shape in before_shapes else ("after",)):
                for ranks in (1, 2):
                    rows.append({"shape": shape, **run_case(model_dir, mode, ranks, args.tokens)})
                    print(json.dumps(rows[-1]), flush=True)
    print(f"\npeak RSS per rank (MB) after building the policy and one step of {args.tokens} tokens per rank; "
          "model = this rank's base shards (bf16) + LoRA, grads, AdamW (fp32)")
    harness.table(("shape", "code", "ranks", "idle MB", "built MB", "peak MB", "model MB", "peak / model",
                   "(peak - idle) / model"),
                  [(r["shape"], r["mode"], r["ranks"], f"{r['idle_mb']:.0f}", f"{r['built_mb']:.0f}",
                    f"{r['peak_mb']:.0f}", f"{r['model_mb']:.0f}", f"{r['peak_mb'] / r['model_mb']:.2f}",
                    f"{(r['peak_mb'] - r['idle_mb']) / r['model_mb']:.2f}") for r in rows])
    extra = {f"{r['shape'].replace('.', '_')}_{r['mode']}_r{r['ranks']}_{figure}": r[figure]
             for r in rows for figure in ("peak_mb", "model_mb", "idle_mb")}
    if args.logits:
        extra.update(logits_figures())
    main_row = next(r for r in reversed(rows) if r["mode"] == "after" and r["ranks"] == 2)
    harness.report("learner_memory", f"peak_rss_per_rank_2_ranks_{main_row['shape']}", main_row["peak_mb"], "MB",
                   main_row["model_mb"], tokens_per_rank=args.tokens, **extra)


if __name__ == "__main__":
    main()
