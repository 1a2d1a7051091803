"""The grouped LoRA ops for vLLM's CPU platform (rollout_worker/backends/vllm_lora_cpu.py) against vLLM's torch ops.

- every op, decode (one adapter index per token) and prefill (one per sequence) shapes, one adapter or several in a
  step, with and without add_inputs: the grouped result equals the torch op's to float rounding;
- a row whose index is -1 (no adapter) gets no LoRA term;
- the session's engine runs with the grouped ops installed in its worker process.

The engine's tokens and log-probs with these ops in place are checked against a transformers reference by
tests/worker/test_vllm_stream.py and test_backends.py (they share the engine).
"""

from __future__ import annotations

import pytest
import torch

from loraflow.rollout_worker.backends import vllm_lora_cpu as grouped

pytestmark = pytest.mark.vllm

NUM_SLOTS, RANK, IN, OUT = 3, 8, 24, 40


@pytest.fixture(scope="module")
def stock():  # noqa: ANN201 - vllm.lora.ops.torch_ops
    from vllm.lora.ops import torch_ops

    return torch_ops


def weights(out: int, inp: int, seed: int) -> torch.Tensor:
    return torch.randn(NUM_SLOTS, 1, out, inp, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("indices", [[1, 1, 1, 1, 1], [0, 2, 2, 1, 0], [2, 0, 0, 0, 0]])
def test_decode_ops_equal_the_torch_ops(stock, indices: list[int]) -> None:  # noqa: ANN001
    idx = torch.tensor(indices)
    x = torch.randn(len(indices), IN, generator=torch.Generator().manual_seed(0))
    a, b = weights(RANK, IN, 1), weights(OUT, RANK, 2)
    got, want = torch.zeros(len(indices), RANK), torch.zeros(len(indices), RANK)
    grouped.bgmv_shrink(x, a, got, idx, 0.5)
    stock.bgmv_shrink(x, a, want, idx, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for add in (True, False):
        base = torch.randn(len(indices), OUT + 4, generator=torch.Generator().manual_seed(3))
        got_y, want_y = base.clone(), base.clone()
        grouped.bgmv_expand(want, b, got_y, idx, add)
        stock.bgmv_expand(want, b, want_y, idx, add)
        torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-6)
        got_y, want_y = base.clone(), base.clone()
        grouped.bgmv_expand_slice(want, b[:, :, :16], got_y, idx, 4, 16, add)
        stock.bgmv_expand_slice(want, b[:, :, :16], want_y, idx, 4, 16, add)
        torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seq_slots", [([3, 2, 4], [1, 1, 1]), ([3, 2, 4], [0, 2, 1]), ([1, 6], [2, 0])])
def test_prefill_ops_equal_the_torch_ops(stock, seq_slots: tuple[list[int], list[int]]) -> None:  # noqa: ANN001
    lens, slots = torch.tensor(seq_slots[0]), torch.tensor(seq_slots[1])
    num = int(lens.sum())
    meta = (torch.cumsum(lens, 0) - lens, lens, slots, len(lens), int(lens.max()), num)
    x = torch.randn(num, IN, generator=torch.Generator().manual_seed(4))
    a, b = weights(RANK, IN, 5), weights(OUT, RANK, 6)
    got, want = torch.zeros(num, RANK), torch.zeros(num, RANK)
    grouped.sgmv_shrink(x, a, got, *meta, 2.0)
    stock.sgmv_shrink(x, a, want, *meta, 2.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    base = torch.randn(num, OUT, generator=torch.Generator().manual_seed(7))
    got_y, want_y = base.clone(), base.clone()
    grouped.sgmv_expand(want, b, got_y, *meta, True)
    stock.sgmv_expand(want, b, want_y, *meta, True)
    torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-6)
    got_y, want_y = base.clone(), base.clone()
    grouped.sgmv_expand_slice(want, b[:, :, :8], got_y, *meta, 8, 8, True)
    stock.sgmv_expand_slice(want, b[:, :, :8], want_y, *meta, 8, 8, True)
    torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-6)


def test_no_adapter_rows_get_no_lora_term() -> None:
    idx = torch.tensor([-1, 1, -1])
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(8))
    a = weights(RANK, IN, 9)
    y = torch.full((3, RANK), 7.0)
    grouped.bgmv_shrink(x, a, y, idx, 1.0)
    assert torch.equal(y[[0, 2]], torch.zeros(2, RANK))
    torch.testing.assert_close(y[1], x[1] @ a[1, 0].t())
    out = torch.ones(3, RANK)
    grouped.bgmv_expand(x[:, :RANK], weights(RANK, RANK, 10), out, torch.tensor([-1, -1, -1]), True)
    assert torch.equal(out, torch.ones(3, RANK))


def test_the_session_engine_runs_the_grouped_ops(vllm_session_backend) -> None:  # noqa: ANN001
    from vllm.platforms import current_platform

    # the grouped ops replace vLLM's CPU punica ops only: elsewhere the engine keeps vLLM's own
    assert vllm_session_backend.grouped_lora_ops is current_platform.is_cpu()
    if current_platform.is_cpu():
        assert vllm_session_backend.llm.collective_rpc("loraflow_grouped_lora_ops") == [True]


def test_row_groups_are_computed_once_per_content_of_their_indices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops of one step share the wrapper's index buffer: its row groups are found once, and again after the
    buffer is written in place (vLLM's update_metadata), never taken from another tensor's entry."""
    computed: list[list[int]] = []
    real = grouped.row_groups
    monkeypatch.setattr(grouped, "row_groups", lambda indices: computed.append(indices.tolist()) or real(indices))
    monkeypatch.setattr(grouped, "_step_groups", grouped.StepGroups(size=2))
    buffer = torch.tensor([0, 1, 1, -1, 0, 0])
    step = buffer[:4]
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(11))
    a = weights(RANK, IN, 12)
    for _ in range(3):
        y = torch.zeros(4, RANK)
        grouped.bgmv_shrink(x, a, y, buffer[:4], 1.0)  # a new view object of the same buffer each call
    assert computed == [[0, 1, 1, -1]]
    torch.testing.assert_close(y[1:3], x[1:3] @ a[1, 0].t())
    buffer[:4].copy_(torch.tensor([2, 2, 2, 2]))  # the next step's mapping
    grouped.bgmv_shrink(x, a, y, step, 1.0)
    assert computed[-1] == [2, 2, 2, 2]
    torch.testing.assert_close(y, x @ a[2, 0].t())
    other = torch.tensor([1, 1, 1, 1])  # another tensor: its own entry (and at most `size` are kept)
    grouped.bgmv_shrink(x, a, y, other, 1.0)
    grouped.bgmv_shrink(x, a, y, buffer[:4], 1.0)
    assert computed[-1] == [1, 1, 1, 1] and len(computed) == 3
    torch.testing.assert_close(y, x @ a[2, 0].t())


@pytest.mark.parametrize("add", [True, False])
def test_mixed_steps_leave_no_adapter_rows_without_a_lora_term(add: bool) -> None:
    idx = torch.tensor([1, -1, 0, 1, -1])
    x = torch.randn(5, RANK, generator=torch.Generator().manual_seed(13))
    b = weights(OUT, RANK, 14)
    base = torch.randn(5, OUT + 4, generator=torch.Generator().manual_seed(15))
    for expand, width in ((lambda y: grouped.bgmv_expand(x, b, y, idx, add), OUT),
                          (lambda y: grouped.bgmv_expand_slice(x, b[:, :, :16], y, idx, 4, 16, add), 16)):
        y = base.clone()
        expand(y)
        offset = 4 if width == 16 else 0
        lora = torch.zeros(5, width)
        for row, slot in enumerate(idx.tolist()):
            if slot >= 0:
                lora[row] = x[row] @ b[slot, 0, :width].t()
        want = base.clone()
        want[:, offset:offset + width] = (want[:, offset:offset + width] if add else 0) + lora
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


def test_inference_tensors_have_their_groups_computed_each_call() -> None:
    """No version counter to trust (torch.inference_mode): computed, not cached, and still right."""
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(16))
    a = weights(RANK, IN, 17)
    with torch.inference_mode():
        idx = torch.tensor([0, 2, 2])
        y = torch.zeros(3, RANK)
        grouped.bgmv_shrink(x, a, y, idx, 1.0)
        idx[:] = torch.tensor([1, 1, 0])
        grouped.bgmv_shrink(x, a, y, idx, 1.0)
    torch.testing.assert_close(y[:2], x[:2] @ a[1, 0].t())
    torch.testing.assert_close(y[2], x[2] @ a[0, 0].t())
