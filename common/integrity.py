"""Policy integrity: what proves that a group's tokens came from the adapter version they claim.

The bug this guards against is silent: an engine that serves the base model, an old adapter (vLLM's int-id
cache, a same-name reload), a truncated or swapped adapter file, another temperature than the config's, or a
client that makes up its log-probs. Everything reports success and the learner trains on the wrong policy.

**What is checked, and why this and not a canary.** A canary (fixed prompts scored by the worker after each
swap, compared with the learner's score) proves only what the worker's canary path loaded, and only as the
worker reports it: a client that fabricates log-probs can compute a correct canary with the real model, and an
engine whose generation path differs from its scoring path (an HTTP route that bypasses the adapter) passes.
So the learner checks the very tokens it is about to train:

1. *Evidence* (:class:`loraflow.common.protocol.ServedAdapter`, one per version in a group): the engine's own name, int id
   and the sha256 of the tensor bytes it loaded. The learner compares the sha256 with what it published for that
   version (``adapter_sha256``) and refuses an int id that named another version earlier in the same worker
   process (``lora_id_reused``). A version without evidence is ``no_evidence``. Cost: a dict lookup.
2. *Exact re-scoring* (``logprobs``): ``integrity.samples_per_group`` samples of a group, chosen by the
   learner at random (a worker cannot know which), are scored under the exact adapter version each token
   claims (the learner keeps the LoRA tensors of the last ``max_staleness + 1`` versions: a few MB), at the run's
   sampling temperature, and compared token by token with the behaviour log-probs (:func:`compare`). This
   catches every fault above, including ones the evidence cannot see (a wrong temperature, made-up numbers,
   weights that differ from the file). Two ways to the same numbers:

   - tokens of the version the parameters hold (the one the learner is about to train from): the training
     forward already computes their log-probs, at the sampling temperature, for the loss. Detached, they *are*
     the check, at no extra forward (:class:`loraflow.learner.integrity.TrainedCheck`). The step is optimistic: the
     comparison runs after backward and before ``optimizer.step()``; a group that fails is dropped and
     forward/backward run again without it (failures are rare, a failing worker is quarantined within
     ``quarantine_after`` groups). Exact only when the training forward computes what an engine does: with
     dropout in train mode (``learner.lora_dropout > 0``) every version is re-scored as below. Training vs
     re-scoring forward, fp32: 9.5e-7 nats at most (``tests/learner/test_integrity_free.py``);
   - tokens of older versions: one no-grad forward of the chosen samples of every older version together,
     before the step (failures are dropped before anything is trained): each LoRA module adds each row's own
     version's delta from the history's tensors (:meth:`loraflow.learner.rescoring.AdapterHistory.scoring`), so the
     parameters are never swapped and ``max_staleness = 2`` (the demo) costs one forward as 1 does.

   Cost: the free path is bookkeeping (~1-2 ms a step on the tiny model, ~1 % of the demo batch's
   forward+backward). A re-scoring forward is not: its rows are ``samples_per_group / group_size`` of the
   batch's, a no-grad forward is about half the arithmetic of a forward+backward, and on a small model a forward
   of a few rows costs more than its arithmetic (Python per module, FSDP2's per-parameter unshard; on a GPU,
   ~1,500 kernel launches whatever its rows): 6-8 % of the demo batch's forward+backward, ~20 % of the test
   harness's, 21 % of the 1.5B shape's on an H200. An asynchronous run's batches hold mostly the previous
   version's tokens (the workers generate with v-1 while the learner trains v-1 -> v), so re-scoring them every
   step costs a forward nearly every step, 3-4 times the 2 % budget (measured: ``bench/integrity.py``,
   BENCHMARKS.md "Policy integrity").

3. *Probation and audits* (:mod:`loraflow.learner.trust`): who is re-scored when. A worker process starts on probation:
   every one of its groups is re-scored as above, until ``integrity.probation_groups`` of them passed in a row.
   After that its tokens of older versions are re-scored only on *audited* steps, drawn per step with
   probability ``integrity.audit_fraction`` from a keyed hash of the learner's secret seed (every rank draws
   the same; no worker can tell which). What stays exact for every group of every worker at every step: the
   evidence (1) and the version the parameters hold (the free path). Any failure puts the worker back on
   probation with a count of 0, and the broker's quarantine rule applies as before.

   What this gives up, and why it is the default: a worker that was honest through its probation and then
   starts to fail *only* in its log-probs of older versions (made-up numbers, another temperature, an engine
   that reports the adapter it loaded but generates without it) is caught at the next audited step, expected
   ``1 / audit_fraction`` steps later, and its groups in between are trained. Everything that fails from a
   worker's start (a misconfigured engine, a cheating client: the faults tests/integrity injects) is caught at
   its first group; a fault that begins with an adapter load shows in the evidence (sha256, a reused int id)
   of that version's first group. The cost falls to the free path plus ``audit_fraction`` re-scoring
   forwards a step, under the 2 % budget at the default 1/16 (``bench/integrity.py``). ``audit_fraction = 1``
   re-scores every group of every worker at every step: exact for all, at the cost above.

   Why not a per-version canary for trusted workers instead: its reference is the learner's log-probs of the
   canary under each version, i.e. a forward per step (the cost above), or an extra row in the training forward
   whose backward runs too: 4 extra rows of the harness's 18 tokens cost 16 % of its forward+backward
   (BENCHMARKS.md), ~4 % a row. On batches of hundreds of rows that row would be cheap; on this project's small
   ones it is over budget by itself.

**Tolerances.** An fp32 engine and an fp32 learner agree to ~1e-5 nats per token (FACTS.md: vLLM 5e-6, hf 1e-6);
bf16 on either side drifts by up to a few tenths on low-probability tokens. :func:`tolerance` gives 0.01 nats
when both are fp32 and 0.25 otherwise (``integrity.token_tolerance`` overrides), measured by
``bench/integrity.py`` on both backends. A sample fails when more than ``integrity.max_off_fraction`` of its
tokens are off by more than the tolerance and, where either side computes in low precision, more than one
(:func:`sample_passes`, :func:`noisy_tokens`): one noisy bf16 token fails nothing, also in a sample of a few
tokens. (A bf16 engine on a GPU against the fp32 learner, 2,048 demo samples of ~3 tokens,
``bench/integrity_bf16.py --device cuda``: 7 tokens over 0.25 nats, each alone in its sample; by the share alone
those 7 samples, 0.34 %, failed, and at 2 failed groups in 8 a long run would sooner or later quarantine a healthy
worker.) Both sides in fp32 agree to ~1e-5, so there a token off by 0.01 is the policy, not noise: an old
adapter served as the next version moves only a token or two of a short sample that far, and must fail it.

**From a failed group to a quarantine.** A failed group is never trained (the learner drops it, reason
``policy_mismatch``, and leaves it out of its BatchAck, so the broker re-queues the prompt) and is reported in
``BatchAck.mismatches``. The broker quarantines a worker process once ``integrity.quarantine_after`` of its
last ``integrity.quarantine_window`` checked groups failed (:mod:`loraflow.broker.quarantine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: per-token tolerance (nats) when both the engine and the learner compute in float32, and otherwise
FP32_TOLERANCE = 0.01
LOW_PRECISION_TOLERANCE = 0.25


def tolerance(engine_dtype: str, learner_dtype: str, configured: float = 0.0) -> float:
    """The per-token tolerance for a comparison between these dtypes (``configured`` > 0 wins)."""
    if configured > 0:
        return configured
    both_fp32 = engine_dtype == "float32" and learner_dtype == "float32"
    return FP32_TOLERANCE if both_fp32 else LOW_PRECISION_TOLERANCE


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """Behaviour vs recomputed log-probs of one sample's checked tokens."""

    num_checked: int
    num_off: int
    max_abs_diff: float
    mean_abs_diff: float
    passed: bool


def compare(behaviour: Sequence[float] | np.ndarray, recomputed: Sequence[float] | np.ndarray, *,
            token_tolerance: float, max_off_fraction: float, noisy_tokens: int = 0) -> Comparison:
    """Compare the log-probs token by token; fails as :func:`sample_passes` says for the tokens off by more than
    ``token_tolerance`` (a non-finite value on either side counts as off), ``noisy_tokens`` of them allowed
    whatever the sample's length. No tokens: passes."""
    b = np.asarray(behaviour, dtype=np.float64)
    r = np.asarray(recomputed, dtype=np.float64)
    if b.shape != r.shape:
        raise ValueError(f"compare: {b.shape} behaviour vs {r.shape} recomputed log-probs")
    num_checked, num_off, max_diff, mean_diff = compare_rows(b.ravel(), r.ravel(), [b.size], [token_tolerance])[0]
    return Comparison(num_checked=int(num_checked), num_off=int(num_off), max_abs_diff=float(max_diff),
                      mean_abs_diff=float(mean_diff),
                      passed=sample_passes(num_off, b.size, max_off_fraction, noisy_tokens))


def noisy_tokens(engine_dtype: str, learner_dtype: str) -> int:
    """Off tokens a sample may have whatever its length: one where either side computes in low precision, none
    when both are float32 (see the module docstring)."""
    return 0 if engine_dtype == "float32" and learner_dtype == "float32" else 1


def sample_passes(num_off: int, num_checked: int, max_off_fraction: float, noisy_tokens: int = 0) -> bool:
    """A sample with ``num_off`` of ``num_checked`` tokens off passes unless more than ``max_off_fraction`` of
    them, and more than ``noisy_tokens``, are off."""
    return num_off <= max(noisy_tokens, max_off_fraction * num_checked)


def compare_rows(behaviour: np.ndarray, recomputed: np.ndarray, counts: Sequence[int],
                 token_tolerances: Sequence[float]) -> np.ndarray:
    """:func:`compare` of many samples at once: ``behaviour`` and ``recomputed`` [T] hold the samples' tokens one
    after the other (``counts[k]`` of sample k, checked at ``token_tolerances[k]``) -> [K, 4] float64 (num_checked,
    num_off, max |diff|, mean |diff|) per sample; the |diff|s of finite values only, inf when a sample has none;
    a sample without tokens is all zeros."""
    b = np.asarray(behaviour, dtype=np.float64)
    r = np.asarray(recomputed, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.int64)
    if b.shape != r.shape or b.ndim != 1 or b.size != counts.sum():
        raise ValueError(f"compare_rows: {b.shape} behaviour vs {r.shape} recomputed log-probs for "
                         f"{counts.sum()} tokens")
    num = len(counts)
    out = np.zeros((num, 4), dtype=np.float64)
    if b.size == 0:
        return out
    rows = np.repeat(np.arange(num), counts)
    diff = np.abs(b - r)
    finite = np.isfinite(diff)
    off = ~finite | (diff > np.repeat(np.asarray(token_tolerances, dtype=np.float64), counts))
    num_finite = np.bincount(rows, weights=finite, minlength=num)
    largest = np.full(num, -np.inf)
    np.maximum.at(largest, rows, np.where(finite, diff, -np.inf))
    has = counts > 0
    out[:, 0] = counts
    out[:, 1] = np.bincount(rows, weights=off, minlength=num)
    out[:, 2] = np.where(num_finite > 0, largest, np.inf)
    out[:, 3] = np.where(num_finite > 0, np.bincount(rows, weights=np.where(finite, diff, 0.0), minlength=num)
                         / np.maximum(num_finite, 1), np.inf)
    out[~has] = 0.0
    return out
