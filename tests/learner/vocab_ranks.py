"""Under torchrun: the row-sharded embedding and head (learner/vocab.py) against the whole matrix on every rank:
rows sent by rank 0, embedding lookups, full logits, and the chunked head's log-probs, entropies and gradients."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from loraflow.common.logprobs import token_entropy, token_logprobs
from loraflow.learner import head, vocab
from loraflow.learner.parallel import init_parallel


def main() -> None:
    torch.set_num_threads(1)
    parallel = init_parallel("cpu")
    vocab_size, hidden_size = 101, 12  # 101 rows: the last rank's piece is shorter
    vocab.PIECE_BYTES = 7 * hidden_size * 4  # pieces of 7 rows: a rank's rows come in several
    g = torch.Generator().manual_seed(0)
    matrix = torch.randn(vocab_size, hidden_size, generator=g)  # the same on every rank (same seed)
    rows = vocab.VocabRows(vocab_size, hidden_size, dtype=torch.float32, parallel=parallel)
    vocab.load_vocab_rows(rows, (lambda start, end: matrix[start:end]) if parallel.is_main else None)
    assert torch.equal(rows.rows, matrix[rows.starts[parallel.rank]:rows.starts[parallel.rank + 1]])
    assert sum(rows.count(r) for r in range(parallel.world_size)) == vocab_size

    g = torch.Generator().manual_seed(1 + parallel.rank)  # each rank its own tokens, as in training
    num_tokens = 17 + 5 * parallel.rank
    ids = torch.randint(0, vocab_size, (2, num_tokens), generator=g)
    torch.testing.assert_close(vocab.ShardedEmbedding(rows)(ids), F.embedding(ids, matrix), rtol=0, atol=0)
    hidden = torch.randn(num_tokens, hidden_size, generator=g)
    torch.testing.assert_close(vocab.ShardedHead(rows)(hidden), hidden @ matrix.T, rtol=0, atol=1e-5)

    targets = torch.randint(0, vocab_size, (num_tokens,), generator=g)
    upstream = torch.randn(num_tokens, generator=g)
    for temperature in (1.0, 0.7):
        leaf = hidden.clone().requires_grad_(True)
        logp, entropy = head.trained_logprobs(leaf, rows, targets, temperature, chunk=5)
        (logp * upstream).sum().backward()
        want = hidden.clone().requires_grad_(True)
        logits = want @ matrix.T
        want_logp = token_logprobs(logits, targets, temperature)
        (want_logp * upstream).sum().backward()
        torch.testing.assert_close(logp, want_logp, rtol=0, atol=1e-5)
        torch.testing.assert_close(entropy, token_entropy(logits.detach(), temperature), rtol=0, atol=1e-5)
        torch.testing.assert_close(leaf.grad, want.grad, rtol=1e-5, atol=1e-5)
    empty, _ = head.trained_logprobs(torch.zeros(0, hidden_size, requires_grad=True), rows,
                                     torch.zeros(0, dtype=torch.int64))  # collective even with no token
    empty.sum().backward()
    parallel.barrier()
    if parallel.is_main:
        print(f"vocab ok on {parallel.world_size} ranks", flush=True)
    parallel.close()


if __name__ == "__main__":
    main()
