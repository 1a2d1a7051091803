"""Learner tests: one torch thread in this process (see tests/torch_threads.py)."""

from tests.torch_threads import one_torch_thread  # noqa: F401  (an autouse fixture for this package)
