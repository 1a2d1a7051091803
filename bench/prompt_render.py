"""Prompt-rendering overhead per group: the chat template next to the generation it feeds, on each model family.

    .venv/bin/python -m bench.prompt_render [--group-size 8] [--tokens 32] [--repeats 5]

For each family of :mod:`loraflow.common.model_zoo` (small random models, built offline into a temporary directory):

- ``render``: what a worker does per group before generating: ``Backend.encode`` of a conversational prompt
  (system + user message) through :class:`loraflow.common.chat.ChatFormat` (the tokenizer's Jinja template, then the
  tokenizer), once per group; plus, per sample, decoding its completion for the reward;
- ``generate``: the hf backend sampling ``--group-size`` completions of ``--tokens`` tokens for that prompt
  (one ``generate`` call, one torch thread, temperature 1, no early stop counted out).

The JSON line's value is the render time per group over the generation time per group, worst family, with a
reference of 0.01 (1 %: "negligible"). The models are ~0.3 M parameters, so generation here is far faster than
with any real model: the share is an upper bound.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.report import report

MESSAGES = [{"role": "system", "content": "You are a careful math tutor. Answer with a number at the end."},
            {"role": "user", "content": "Ada has 37 apples and buys 48 more. Then she gives 12 to Ben. "
                                        "How many apples does Ada have now?"}]


def median_s(fn, repeats: int) -> float:  # noqa: ANN001 - bench helper
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = harness.parser(__doc__, repeats=5)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = harness.parse(parser, None, tokens=4, repeats=1)

    import torch

    from loraflow.common.model_zoo import FAMILIES, build_model
    from loraflow.rollout_worker.backends.base import GenRequest, Sampling
    from loraflow.rollout_worker.backends.hf import HfBackend

    torch.set_num_threads(1)
    shares = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'family':8} {'render/group ms':>16} {'generate/group ms':>18} {'share':>8}")
        for family in sorted(FAMILIES):
            backend = HfBackend(build_model(family, Path(tmp) / family), sampling=Sampling(), device="cpu")
            prompt_ids = backend.encode(MESSAGES)
            requests = [GenRequest(token_ids=prompt_ids, max_tokens=args.tokens, version=0, key=str(i))
                        for i in range(args.group_size)]
            outputs = backend.generate(requests)  # warm-up

            def render_group(backend=backend, outputs=outputs) -> None:
                backend.encode(MESSAGES)
                for output in outputs:
                    backend.decode(output.token_ids)

            render_s = median_s(render_group, args.repeats * 20)
            generate_s = median_s(lambda backend=backend, requests=requests: backend.generate(requests),
                                  args.repeats)
            shares[family] = render_s / generate_s
            print(f"{family:8} {render_s * 1e3:16.3f} {generate_s * 1e3:18.1f} {shares[family]:8.2%}")
    worst = max(shares, key=shares.get)
    report("prompt_render", "render_share_of_generation_per_group", shares[worst], "ratio", 0.01,
           worst_family=worst, group_size=args.group_size, tokens=args.tokens,
           shares={k: round(v, 5) for k, v in shares.items()})


if __name__ == "__main__":
    main()
