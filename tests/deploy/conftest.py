"""Deploy tests run the demo's models in-process: one torch thread (see tests/torch_threads.py)."""

from tests.torch_threads import one_torch_thread  # noqa: F401  (an autouse fixture for this package)
