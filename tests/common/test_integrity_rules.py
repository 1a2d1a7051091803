"""The per-sample comparison rule and the tolerances of common/integrity.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loraflow.common.integrity import (
    FP32_TOLERANCE,
    LOW_PRECISION_TOLERANCE,
    compare,
    noisy_tokens,
    sample_passes,
    tolerance,
)

RULE = {"token_tolerance": 0.01, "max_off_fraction": 0.1}


@pytest.mark.parametrize(("behaviour", "recomputed", "passed", "num_off"), [
    ([], [], True, 0),                                                  # nothing to check
    ([-1.0] * 20, [-1.0 + 1e-6] * 20, True, 0),                         # fp32 agreement
    ([-1.0] * 20, [-1.0] * 19 + [-3.0], True, 1),                       # one noisy token of 20 fails nothing
    ([-1.0] * 20, [-1.0] * 17 + [-3.0] * 3, False, 3),                  # 15 % off: sustained
    ([-0.05] * 10, [-2.3] * 10, False, 10),                             # made-up confident log-probs
    ([-1.0] * 10, [-1.0] * 9 + [math.nan], True, 1),                    # a NaN counts as off
    ([-1.0] * 4, [-1.0] * 3 + [-1.5], False, 1),                        # 1 of 4 is over the 10 % share (fp32 both)
    ([-1.0] * 40, [-1.0] * 36 + [-3.0] * 4, True, 4),                   # 10 % of 40: 4 off pass,
    ([-1.0] * 40, [-1.0] * 35 + [-3.0] * 5, False, 5),                  # 5 fail
])
def test_compare(behaviour, recomputed, passed, num_off):
    result = compare(behaviour, recomputed, **RULE)
    assert (result.passed, result.num_off, result.num_checked) == (passed, num_off, len(behaviour))


@pytest.mark.parametrize(("num_off", "num_checked", "engine", "passed"), [
    (1, 3, "bfloat16", True),    # one noisy low-precision token of a short sample fails nothing
    (2, 4, "bfloat16", False),   # two are over the share, and not one alone
    (1, 3, "float32", False),    # fp32 both: 0.01 nats off is the policy, not noise (an old adapter's tokens)
    (4, 40, "float32", True),    # the share holds either way
])
def test_one_noisy_token_is_allowed_where_either_side_is_low_precision(num_off, num_checked, engine, passed):
    assert sample_passes(num_off, num_checked, 0.1, noisy_tokens(engine, "float32")) == passed
    assert noisy_tokens("float32", "bfloat16") == 1 and noisy_tokens("float32", "float32") == 0


def test_compare_reports_the_differences():
    result = compare(np.array([-1.0, -2.0]), np.array([-1.5, -2.0]), **RULE)
    assert result.max_abs_diff == pytest.approx(0.5) and result.mean_abs_diff == pytest.approx(0.25)


def test_compare_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="behaviour vs"):
        compare([-1.0], [-1.0, -2.0], **RULE)


@pytest.mark.parametrize(("engine", "learner", "configured", "expected"), [
    ("float32", "float32", 0.0, FP32_TOLERANCE),
    ("bfloat16", "float32", 0.0, LOW_PRECISION_TOLERANCE),
    ("float32", "bfloat16", 0.0, LOW_PRECISION_TOLERANCE),
    ("bfloat16", "bfloat16", 0.5, 0.5),
])
def test_tolerance(engine, learner, configured, expected):
    assert tolerance(engine, learner, configured) == expected
