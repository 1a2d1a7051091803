"""Prompt-rendering overhead per group: the chat template next to the generation it feeds, on each model family.

    .venv/bin/python -m bench.prompt_render [--group-size 8] [--tokens 32] [--repeats 5]

Per family of ``loraflow.common.model_zoo`` (~0.3 M-parameter random models, so the share is an upper bound):
``render`` is what a worker does per group before generating (``Backend.encode`` of a system + user prompt through
the chat template, then decoding each completion for the reward); ``generate`` is the hf backend sampling
``--group-size`` completions of ``--tokens`` tokens (one call, one torch thread). The JSON line's value is render
over generate, worst family, against a reference of 0.01 (1 %: negligible).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench import harness

MESSAGES = [{"role": "system", "content": "You are a careful math tutor. Answer with a number at the end."},
            {"role": "user", "content": "Ada has 37 apples and buys 48 more. Then she gives 12 to Ben. "
                                        "How many apples does Ada have now?"}]


def median_s(fn, repeats: int) -> float:  # noqa: ANN001
    def timed() -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    return harness.median(timed() for _ in range(repeats))


def main() -> None:
    args = harness.parse(harness.flags(harness.parser(__doc__, repeats=5), {"group_size": 8, "tokens": 32}), None,
                         tokens=4, repeats=1)

    import torch

    from loraflow.common.model_zoo import FAMILIES, build_model
    from loraflow.rollout_worker.backends.base import GenRequest

    torch.set_num_threads(1)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in sorted(FAMILIES):
            backend = harness.tiny_backend("hf", build_model(family, Path(tmp) / family))
            prompt_ids = backend.encode(MESSAGES)
            requests = [GenRequest(token_ids=prompt_ids, max_tokens=args.tokens, version=0, key=str(i))
                        for i in range(args.group_size)]
            outputs = backend.generate(requests)  # warm-up

            def render_group(backend=backend, outputs=outputs) -> None:
                backend.encode(MESSAGES)
                for output in outputs:
                    backend.decode(output.token_ids)

            rows[family] = (median_s(render_group, args.repeats * 20),
                            median_s(lambda backend=backend, requests=requests: backend.generate(requests), args.repeats))
    shares = {family: render_s / generate_s for family, (render_s, generate_s) in rows.items()}
    harness.table(("family", "render / group", "generate / group", "share"),
                  [(f, f"{r * 1e3:.3f} ms", f"{g * 1e3:.1f} ms", f"{shares[f]:.2%}") for f, (r, g) in rows.items()])
    worst = max(shares, key=shares.get)
    harness.report("prompt_render", "render_share_of_generation_per_group", shares[worst], "ratio", 0.01,
                   worst_family=worst, group_size=args.group_size, tokens=args.tokens,
                   shares={k: round(v, 5) for k, v in shares.items()})


if __name__ == "__main__":
    main()
