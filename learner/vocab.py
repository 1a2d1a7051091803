"""The input embedding and the output head, row-sharded over the ranks outside FSDP2 and never gathered whole.

Both are frozen ``[V, H]`` matrices (loraflow never trains them, :mod:`loraflow.common.lora_targets`), tied in many
small models, and the largest tensors of a model with a 151,936-token vocabulary: 467 MB in bf16 at the Qwen2-1.5B
shape. In an FSDP2 group of their own or the root's, every forward all-gathers the whole matrix (and FSDP2's
copy-out holds it twice for a moment), and the root keeps it gathered until the end of the backward: at 2 ranks
that was the peak of a rank's memory. Here each rank keeps rows ``[start_r, start_r + n_r)`` (FSDP2's dim-0
chunks: ceil(V / R) rows each) in :class:`VocabRows`, and a use walks the ranks' pieces one at a time::

    for r in 0 .. R-1:   piece = rank r's rows (broadcast from rank r; a rank's own are not copied)
                         embedding: the hidden rows of the ids in [start_r, start_r + n_r)
                         head:      logits over those vocabulary ids, merged into a running logsumexp
                                    (loraflow.learner.head; its backward walks the pieces again)

so a rank holds its own rows and one piece of another's (at most 64 MB) at a time. Every use is collective:
the ranks run it in the same order (every forward of the learner is). On one rank the single piece is the whole
matrix and nothing is sent.

Loading: rank 0 reads each rank's rows from the weights files (a slice at a time, plain reads) and sends them
(:func:`load_vocab_rows`). The rows are plain tensors held by the modules, neither parameters nor buffers:
checkpoints (trainable state only) and published adapters do not contain them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from loraflow.learner.parallel import Parallel

#: the largest piece of another rank's rows held at a time
PIECE_BYTES = 64 << 20


class VocabRows:
    """This rank's rows of a frozen [V, H] matrix and the walk over every rank's rows (collective)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, parallel: Parallel) -> None:
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.rank, self.world_size = parallel.rank, parallel.world_size
        self.group = parallel.mesh.get_group() if parallel.world_size > 1 else None
        size = -(-vocab_size // self.world_size)
        self.starts = [min(r * size, vocab_size) for r in range(self.world_size + 1)]
        self.rows = torch.empty(self.count(self.rank), hidden_size, dtype=dtype, device=parallel.device)

    def count(self, rank: int) -> int:
        return self.starts[rank + 1] - self.starts[rank]

    @property
    def num_bytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def pieces(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(first vocabulary id, rows [n, H]) of every rank in rank order, in slices of at most
        :data:`PIECE_BYTES`; a piece is valid until the next. One rank: its rows, whole."""
        if self.world_size == 1:
            yield 0, self.rows
            return
        step = max(1, PIECE_BYTES // (self.hidden_size * self.rows.element_size()))
        buffer = torch.empty(min(step, max(self.count(r) for r in range(self.world_size))), self.hidden_size,
                             dtype=self.rows.dtype, device=self.rows.device)
        for r in range(self.world_size):
            for start in range(0, self.count(r), step):
                end = min(start + step, self.count(r))
                piece = self.rows[start:end] if r == self.rank else buffer[:end - start]
                dist.broadcast(piece, src=dist.get_global_rank(self.group, r), group=self.group)
                yield self.starts[r] + start, piece
        del buffer


class ShardedEmbedding(nn.Module):
    """``nn.Embedding``'s forward over :class:`VocabRows` (times ``scale``, for models that scale inside it)."""

    def __init__(self, rows: VocabRows, scale: float | torch.Tensor | None = None) -> None:
        super().__init__()
        self.vocab_rows = rows
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_rows.world_size == 1:
            out = F.embedding(input_ids, self.vocab_rows.rows)
            return out if self.scale is None else out * torch.as_tensor(self.scale, dtype=out.dtype,
                                                                        device=out.device)
        out = torch.zeros(*input_ids.shape, self.vocab_rows.hidden_size, dtype=self.vocab_rows.rows.dtype,
                          device=input_ids.device)
        for start, piece in self.vocab_rows.pieces():
            mine = (input_ids >= start) & (input_ids < start + piece.shape[0])
            out[mine] = piece[input_ids[mine] - start]
        if self.scale is not None:
            out = out * torch.as_tensor(self.scale, dtype=out.dtype, device=out.device)
        return out


class ShardedHead(nn.Module):
    """The output head over :class:`VocabRows`: full ``[.., V]`` logits (for tests and tools; the learner's
    loss uses :func:`loraflow.learner.head.trained_logprobs` on the trained positions only)."""

    def __init__(self, rows: VocabRows) -> None:
        super().__init__()
        self.vocab_rows = rows

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(hidden, piece) for _, piece in self.vocab_rows.pieces()], dim=-1)


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def shard_vocab(base: nn.Module, hf_config, *, dtype: torch.dtype, parallel: Parallel,
                rows: dict[str, VocabRows] | None = None) -> dict[str, VocabRows]:
    """Replace the (meta) input embedding and output head of ``base`` by their row-sharded forms (the head shares
    the embedding's rows where the config ties them); returns weights-file name -> rows to load. ``rows``: loaded
    rows to hold instead (another model's over the same weights, by weights-file name)."""
    embedding, output = base.get_input_embeddings(), base.get_output_embeddings()
    vocab_size, hidden_size = embedding.weight.shape
    names = {"embedding": _module_name(base, embedding) + ".weight", "head": _module_name(base, output) + ".weight"}

    def take(name: str, size: int) -> VocabRows:
        if rows is not None:
            return rows[name]
        return VocabRows(size, hidden_size, dtype=dtype, parallel=parallel)

    embedding_rows = take(names["embedding"], vocab_size)
    base.set_input_embeddings(ShardedEmbedding(embedding_rows, getattr(embedding, "embed_scale", None)))
    out = {names["embedding"]: embedding_rows}
    if getattr(hf_config, "tie_word_embeddings", False):
        base.set_output_embeddings(ShardedHead(embedding_rows))
    else:
        head_rows = take(names["head"], output.weight.shape[0])
        base.set_output_embeddings(ShardedHead(head_rows))
        out[names["head"]] = head_rows
    return out


def load_vocab_rows(rows: VocabRows, read: Callable[[int, int], torch.Tensor] | None) -> None:
    """Collective: rank 0 reads rows ``[start, end)`` of the matrix with ``read`` (None elsewhere), at most
    :data:`PIECE_BYTES` at a time, and sends each rank its rows."""
    step = max(1, PIECE_BYTES // (rows.hidden_size * rows.rows.element_size()))
    for r in range(rows.world_size):
        for start in range(0, rows.count(r), step):
            end = min(start + step, rows.count(r))
            if rows.rank == 0:
                piece = read(rows.starts[r] + start, rows.starts[r] + end).to(rows.rows.device)
                if r == 0:
                    rows.rows[start:end] = piece
                else:
                    dist.send(piece.contiguous(), dst=dist.get_global_rank(rows.group, r), group=rows.group)
                del piece
            elif rows.rank == r:
                received = torch.empty_like(rows.rows[start:end])
                dist.recv(received, src=dist.get_global_rank(rows.group, 0), group=rows.group)
                rows.rows[start:end] = received


def read_rows(path: Path, key: str, start: int, end: int) -> torch.Tensor:
    """Rows ``[start, end)`` of the 2-D tensor ``key`` of a safetensors file, read with plain file reads (a
    memory map would leave the pages read in this process's RSS until the file is closed)."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_len))[key]
        dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
        width = entry["shape"][1]
        row_bytes = width * torch.empty((), dtype=dtype).element_size()
        f.seek(8 + header_len + entry["data_offsets"][0] + start * row_bytes)
        data = bytearray(f.read((end - start) * row_bytes))
    return torch.frombuffer(data, dtype=dtype).view(end - start, width)


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def vocab_rows_of(model: nn.Module) -> list[VocabRows]:
    """The distinct row-sharded matrices of a model (one when tied)."""
    found: dict[int, VocabRows] = {}
    for module in model.modules():
        if isinstance(module, (ShardedEmbedding, ShardedHead)):
            found.setdefault(id(module.vocab_rows), module.vocab_rows)
    return list(found.values())

