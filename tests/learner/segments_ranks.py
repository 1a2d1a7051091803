"""Under torchrun: a step with rows longer than the budget on several ranks (one rank splits a row in 4, another
in 2 and packs the rest), against the same step unsplit: every rank's log-probs, sums and gradient shards agree."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from loraflow.learner.parallel import init_parallel
from tests.learner.test_segments import per_row, run, step_batch


def main() -> None:
    torch.set_num_threads(1)
    parallel = init_parallel("cpu")
    model_dir = Path(sys.argv[1])  # the tiny model, built by the test
    step = step_batch([(30, 120), (5, 60), (3, 9), (7, 20), (2, 6), (4, 4)])
    split, split_seen, split_grads, widths = run(model_dir, parallel, step, budget=40, checkpointing="on",
                                                 kl_beta=0.1)
    whole, whole_seen, whole_grads, _ = run(model_dir, parallel, step, budget=1000, checkpointing="on",
                                            kl_beta=0.1)
    parallel.barrier()
    assert max(widths) <= 40, widths
    split_rows, whole_rows = per_row(split_seen, step), per_row(whole_seen, step)
    assert split_rows.keys() == whole_rows.keys() and split_rows
    for row, want in whole_rows.items():
        torch.testing.assert_close(split_rows[row], want, rtol=0, atol=1e-5)
    torch.testing.assert_close(split.sums, whole.sums, rtol=1e-6, atol=1e-5)
    assert split_grads.keys() == whole_grads.keys() and whole_grads
    for name, want in whole_grads.items():
        torch.testing.assert_close(split_grads[name], want, rtol=1e-4, atol=1e-5, msg=name)
    print(f"rank {parallel.rank}: rows {sorted(split_rows)}, {len(widths)} forwards", flush=True)
    parallel.barrier()
    if parallel.is_main:
        print(f"segments ok on {parallel.world_size} ranks", flush=True)
    parallel.close()


if __name__ == "__main__":
    main()
