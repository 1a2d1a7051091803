"""The demo's base model: the built-in tiny model after a short supervised warm-up, built once and cached.

A random-init model never earns a reward on arithmetic, so RL has nothing to reinforce (FACTS.md). The demo
therefore starts from a base that is like a weak pretrained model: it has seen correct additions, then was
taught a sloppier habit, so it answers carry-free problems and mostly fails the others. RL must bring back
what the base already half knows. The recipe, in fp32 with AdamW on every weight:

1. ``correct``: batches of train-split problems with correct answers, at least ``min_correct_steps`` and then
   until the model adds correctly on the train split (``carry_learned_accuracy``), at most
   ``max_correct_steps``;
2. ``sloppy``: ``sloppy_steps`` more steps where a fraction ``drop_fraction`` of labels drop every carry (each
   digit column summed mod 10: ``47+38=75``), the learning rate decaying linearly to 10 %.

The result is checked on the held-out eval split (greedy, :mod:`loraflow.deploy.evaluate`): carry-free problems must
be answered (``min_carry_free_accuracy``) and the overall accuracy must lie in ``accuracy_window`` (low
enough to leave RL +50 points, high enough to give it a signal). While it does not, the sloppy phase runs
``extra_steps`` more, at most ``max_extra_rounds`` times; a base that still fails is an error.

Everything is seeded (init, data) and runs on one thread (a fixed float summation order; also, two OpenMP
threads that spin on a busy 2-core machine made a step 7x slower than one in a measurement here), so a seed
always gives the same base. The build happens in a temporary directory renamed into
``<cache>/demo-s<seed>-<recipe hash>`` (atomic; a racing second builder just discards its copy).
``loraflow_model.json`` records the recipe, the steps taken and the measured accuracies, and
``<cache>/demo-s<seed>`` is a symlink to the base last built or found for that seed: how the roles started by
hand (which never import deploy/, nor build this themselves) resolve ``model.path = "builtin:demo"``.
``python -m loraflow.deploy.demo_base --seed 0`` builds ahead of time (and points the link).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraflow.common.logging import get_logger
from loraflow.common.tasks import ArithTask
from loraflow.common.tiny_model import build_tiny_model, default_cache_dir, demo_base_link

log = get_logger("demo_base")

METADATA_FILE = "loraflow_model.json"


@dataclass(frozen=True, slots=True)
class Recipe:
    """How the demo base is trained and what it must achieve; part of the cache key."""

    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 50
    grad_clip: float = 1.0
    min_correct_steps: int = 700
    max_correct_steps: int = 1500
    carry_learned_accuracy: float = 0.9
    check_every: int = 100
    sloppy_steps: int = 400
    drop_fraction: float = 0.8
    extra_steps: int = 100
    max_extra_rounds: int = 4
    min_carry_free_accuracy: float = 0.9
    accuracy_window: tuple[float, float] = (0.15, 0.45)
    num_eval_prompts: int = 200
    max_new_tokens: int = 6
    num_threads: int = 1

    def fingerprint(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:8]


#: a base for the code paths, not the figures: one short correct phase (150 steps, about half a minute on 2 cores),
#: no sloppy phase, no accuracy window; a few % greedy, enough for GRPO groups with signal. The suite's end-to-end
#: runs and the benches' ``--quick`` modes train on it.
QUICK_RECIPE = Recipe(lr=2e-3, min_correct_steps=150, max_correct_steps=150, sloppy_steps=0, max_extra_rounds=0,
                      min_carry_free_accuracy=0.0, accuracy_window=(0.0, 1.0), num_eval_prompts=50)


def quick_cache_dir() -> Path:
    """``<cache>/quick``: where quick bases are cached, apart from the demo's, so ``builtin:demo`` never names one."""
    return default_cache_dir() / "quick"


def ensure_quick_base(seed: int = 0) -> Path:
    """The cached :data:`QUICK_RECIPE` base for ``seed`` (built first if it is not there yet)."""
    return ensure_demo_base(seed, quick_cache_dir(), QUICK_RECIPE)


class DemoBaseError(RuntimeError):
    """The warm-up did not produce a usable base; the message says what was measured."""


def operands(prompt: str) -> tuple[int, int]:
    """(a, b) of an arith prompt ``"a+b="``."""
    left, _, right = prompt.removesuffix("=").partition("+")
    return int(left), int(right)


def carry_dropped_sum(a: int, b: int) -> str:
    """``a + b`` with every carry dropped: each digit column summed mod 10 (``47+38`` -> ``"75"``)."""
    da, db = str(a)[::-1], str(b)[::-1]
    width = max(len(da), len(db))
    da, db = da.ljust(width, "0"), db.ljust(width, "0")
    return "".join(str((int(x) + int(y)) % 10) for x, y in zip(da, db, strict=True))[::-1]


def has_carry(a: int, b: int) -> bool:
    return carry_dropped_sum(a, b) != str(a + b)


def demo_base_dir(seed: int, cache_dir: str | os.PathLike | None = None, recipe: Recipe = Recipe()) -> Path:
    return Path(cache_dir or default_cache_dir()) / f"demo-s{seed}-{recipe.fingerprint()}"


def read_metadata(directory: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(directory) / METADATA_FILE).read_text())


def ensure_demo_base(seed: int = 0, cache_dir: str | os.PathLike | None = None, recipe: Recipe = Recipe()) -> Path:
    """The cached demo base for ``seed``, built first if it is not there yet; ``<cache>/demo-s<seed>`` then
    points at it, so every role finds ``builtin:demo`` (:func:`loraflow.common.tiny_model.find_demo_base`)."""
    target = demo_base_dir(seed, cache_dir, recipe)
    if not (target / METADATA_FILE).is_file():
        build_into(target, lambda directory: build_demo_base(directory, seed=seed, recipe=recipe))
    _point_link(demo_base_link(seed, cache_dir), target)
    return target


def _point_link(link: Path, target: Path) -> None:
    """Make ``link`` a relative symlink to ``target`` (atomically: a new link renamed over the old one)."""
    if link.is_symlink() and os.readlink(link) == target.name:
        return
    tmp = link.with_name(f".{link.name}.{os.getpid()}.link")
    tmp.unlink(missing_ok=True)
    os.symlink(target.name, tmp)
    os.replace(tmp, link)


def build_into(target: Path, build: Callable[[Path], Any]) -> None:
    """``build(directory)`` in a temporary directory beside ``target``, renamed into place when done (a reader
    never sees half a model; a concurrent build that finished first wins)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / METADATA_FILE).is_file():
            raise
        log.info("base_built_elsewhere", path=str(target))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_demo_base(directory: str | os.PathLike, *, seed: int, recipe: Recipe = Recipe()) -> dict[str, Any]:
    """Build the tiny model in ``directory``, warm it up, check it, save it; returns the metadata written."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    directory = Path(directory)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.num_threads)
    try:
        with torch.random.fork_rng():
            build_tiny_model(directory, seed=seed)
            torch.manual_seed(seed)
            tokenizer = AutoTokenizer.from_pretrained(str(directory))
            model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
            trainer = _WarmUp(model, tokenizer, ArithTask(seed), recipe, random.Random(f"demo-base/{seed}"))
            metadata = trainer.run()
        model.save_pretrained(str(directory), safe_serialization=True)
    finally:
        torch.set_num_threads(threads)
    metadata.update(kind="demo", seed=seed, recipe=dataclasses.asdict(recipe), build_s=round(time.perf_counter() - start, 1))
    (directory / METADATA_FILE).write_text(json.dumps(metadata, indent=1))
    log.info("demo_base_ready", base_accuracy=metadata["base_accuracy"], build_s=metadata["build_s"])
    return metadata


class _WarmUp:
    """The supervised warm-up loop: batches, optimizer, schedule, and the checks between phases."""

    def __init__(self, model: Any, tokenizer: Any, task: ArithTask, recipe: Recipe, rng: random.Random) -> None:
        import torch

        self.model, self.tokenizer, self.task, self.recipe, self.rng = model, tokenizer, task, recipe, rng
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=0.0)
        self.num_steps = 0

    def run(self) -> dict[str, Any]:
        recipe = self.recipe
        self.model.train()
        train_accuracy = 0.0
        while self.num_steps < recipe.max_correct_steps:
            self.train(recipe.check_every if self.num_steps >= recipe.min_correct_steps
                       else recipe.min_correct_steps - self.num_steps, drop_fraction=0.0)
            train_accuracy = self.measure("train").accuracy
            log.info("demo_base_correct_phase", step=self.num_steps, train_accuracy=train_accuracy)
            if train_accuracy >= recipe.carry_learned_accuracy:
                break
        correct_steps = self.num_steps
        self.train(recipe.sloppy_steps, drop_fraction=recipe.drop_fraction, decay=True)
        low, high = recipe.accuracy_window
        for extra_round in range(recipe.max_extra_rounds + 1):
            result = self.measure("eval")
            breakdown = self.breakdown(result)
            log.info("demo_base_check", step=self.num_steps, accuracy=result.accuracy, **breakdown)
            if breakdown["carry_free_accuracy"] >= recipe.min_carry_free_accuracy and low <= result.accuracy <= high:
                break
            if extra_round == recipe.max_extra_rounds:
                raise DemoBaseError(
                    f"the demo base warm-up did not converge after {self.num_steps} steps: held-out accuracy "
                    f"{result.accuracy:.1%} (wanted {low:.0%}-{high:.0%}), carry-free "
                    f"{breakdown['carry_free_accuracy']:.1%} (wanted >= {recipe.min_carry_free_accuracy:.0%}); "
                    "try another run.seed or pass a model directory as model.path")
            self.train(recipe.extra_steps, drop_fraction=recipe.drop_fraction, decay=True)
        return {"base_accuracy": result.accuracy, **breakdown, "train_accuracy_after_correct": train_accuracy,
                "correct_steps": correct_steps, "sloppy_steps": self.num_steps - correct_steps,
                "num_eval_prompts": result.num_prompts, "max_new_tokens": recipe.max_new_tokens}

    def train(self, num_steps: int, *, drop_fraction: float, decay: bool = False) -> None:
        import torch

        recipe = self.recipe
        for i in range(num_steps):
            warmup = min(1.0, (self.num_steps + 1) / recipe.warmup_steps)
            lr_scale = 1.0 - 0.9 * i / max(1, num_steps - 1) if decay else 1.0
            for group in self.optimizer.param_groups:
                group["lr"] = recipe.lr * warmup * lr_scale
            input_ids, labels = self.batch(drop_fraction)
            loss = self.model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), recipe.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.num_steps += 1

    def batch(self, drop_fraction: float) -> tuple[Any, Any]:
        """(input_ids, labels) of ``batch_size`` train problems; the loss covers answer + EOS only."""
        import torch

        rows, targets = [], []
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        for _ in range(self.recipe.batch_size):
            item = self.task.item(self.rng.randrange(1 << 40), "train")
            answer = item.answer
            if drop_fraction and self.rng.random() < drop_fraction:
                answer = carry_dropped_sum(*operands(item.prompt))
            prompt_ids = self.tokenizer(item.prompt).input_ids
            answer_ids = self.tokenizer(answer).input_ids + [eos]
            rows.append(prompt_ids + answer_ids)
            targets.append([-100] * len(prompt_ids) + answer_ids)
        width = max(map(len, rows))
        # right padding under a causal mask never influences earlier positions; padded labels are ignored
        input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        labels = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
        return input_ids, labels

    def measure(self, split: str) -> Any:
        from loraflow.deploy.evaluate import evaluate

        self.model.eval()
        try:
            return evaluate(self.model, self.tokenizer, self.task, num_prompts=self.recipe.num_eval_prompts,
                            max_new_tokens=self.recipe.max_new_tokens, split=split)
        finally:
            self.model.train()

    @staticmethod
    def breakdown(result: Any) -> dict[str, float]:
        """Accuracy on problems without and with a carry."""
        carry = [has_carry(*operands(p)) for p in result.prompts]
        free_hits = [ok for ok, c in zip(result.correct, carry, strict=True) if not c]
        carry_hits = [ok for ok, c in zip(result.correct, carry, strict=True) if c]
        return {"carry_free_accuracy": sum(free_hits) / max(1, len(free_hits)),
                "carry_accuracy": sum(carry_hits) / max(1, len(carry_hits))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraflow.deploy.demo_base", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default="", help="default: $LORAFLOW_CACHE or ~/.cache/loraflow")
    args = parser.parse_args(argv)
    from loraflow.common.logging import setup_logging

    setup_logging("demo_base")
    path = ensure_demo_base(args.seed, args.cache_dir or None)
    meta = read_metadata(path)
    print(f"{path}\nbase accuracy: {meta['base_accuracy']:.1%} (carry-free {meta['carry_free_accuracy']:.1%}, "
          f"with a carry {meta['carry_accuracy']:.1%}; built in {meta['build_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
