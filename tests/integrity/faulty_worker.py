"""A real rollout worker process with one engine fault injected: ``python -m tests.integrity.faulty_worker FAULT
[worker args]``.

Each fault is a bug class seen in the field that leaves every report green (see common/integrity.py). The fault
is patched into the worker's own classes before :func:`loraflow.rollout_worker.main.main` runs, so everything else (the
broker session, leases, evidence, submission) is the production code path; nothing in the project itself has a
switch for it. ``LORAFLOW_FAULT_AFTER_VERSION`` N (default 0) keeps the worker healthy until the backend holds a
newer version than N (``stale_lora_id``: for its first N adapter loads), so a test can let it contribute good
groups first; ``LORAFLOW_FAULT_GATE``
(:mod:`tests.integrity.gate`) holds it after its imports until the test lets it join.

- ``base_model`` (hf): the engine serves the base model whatever version a request names (an adapter that was
  never applied), while the tokens still claim that version;
- ``stale_lora_id`` (vllm): every version is loaded under LoRA int id 1 without ``load_inplace``: vLLM keeps
  serving the weights first cached under that id (FACTS.md's stale-cache trap);
- ``swapped_files`` (hf or vllm): each received adapter's weights file is replaced on disk by the previous
  version's before the engine loads it (a sync bug that leaves an old file under a new name);
- ``temperature`` (hf): the engine samples and reports its log-probs at temperature 0.6 while the run's config
  says ``worker.temperature`` (the one the learner scores at); with ``LORAFLOW_FAULT_AFTER_VERSION`` N, from its
  first load of a version newer than N, and with ``LORAFLOW_FAULT_TURN`` (a file) from the first load after that
  file exists (a worker that was healthy through its probation, then goes wrong; it logs ``fault_started``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from typing import Any

from loraflow.common.logging import get_logger

FAULTS = ("base_model", "stale_lora_id", "swapped_files", "temperature")
FAULT_TEMPERATURE = 0.6
TURN_ENV = "LORAFLOW_FAULT_TURN"  # a file: the fault begins at the first load after it exists (temperature)


def _after() -> int:
    return int(os.environ.get("LORAFLOW_FAULT_AFTER_VERSION", "0"))


def _turned() -> bool:
    """Whether the fault may begin: no turn file named, or it exists."""
    turn = os.environ.get(TURN_ENV)
    return not turn or os.path.exists(turn)


def inject_base_model() -> None:
    import contextlib

    from loraflow.rollout_worker.backends.hf import HfBackend

    healthy = HfBackend._using

    @contextlib.contextmanager
    def base_always(self: HfBackend, version: int) -> Any:
        if version <= _after():
            with healthy(self, version):
                yield
            return
        with self.model.disable_adapter():
            yield

    HfBackend._using = base_always


def inject_stale_lora_id() -> None:
    from loraflow.rollout_worker.backends.vllm import VllmBackend

    healthy_id = VllmBackend.new_lora_id
    healthy_unload = VllmBackend._unload

    def new_lora_id(self: VllmBackend) -> int:
        """The ids 1, 2, ... until the fault starts, then 1 for ever (vLLM keeps what it cached under 1)."""
        lora_id = healthy_id(self)
        return lora_id if lora_id <= _after() else 1

    def unload(self: VllmBackend, version: int) -> None:
        lora_id = self._requests[version].lora_int_id
        if any(r.lora_int_id == lora_id for v, r in self._requests.items() if v != version):
            self._requests.pop(version)  # another resident version shares the id: the engine keeps its cache
            return
        healthy_unload(self, version)

    VllmBackend.new_lora_id = new_lora_id
    VllmBackend._unload = unload


def inject_swapped_files() -> None:
    from loraflow.rollout_worker import adapters

    healthy = adapters.AdapterStore.receive

    def receive(self: adapters.AdapterStore, update: Any, specs: Any, frames: Any) -> Any:
        previous = max((v for v in self.adapters if v < update.version), default=None)
        adapter = healthy(self, update, specs, frames)
        if update.version > _after() and previous is not None:
            shutil.copyfile(self.adapters[previous].path / adapters.WEIGHTS_FILE, adapter.path / adapters.WEIGHTS_FILE)
        return adapter

    adapters.AdapterStore.receive = receive


def inject_temperature() -> None:
    from loraflow.rollout_worker import worker

    healthy = worker.make_backend

    def make_backend(config: Any, **kwargs: Any) -> Any:
        backend = healthy(config, **kwargs)
        if _after() == 0 and not os.environ.get(TURN_ENV):
            backend.sampling = dataclasses.replace(backend.sampling, temperature=FAULT_TEMPERATURE)
            return backend
        add_adapter = backend.add_adapter

        def add_then_turn(adapter: Any) -> None:
            """Healthy until it loads a version newer than N (after the turn file exists): from then on every
            request samples at 0.6."""
            add_adapter(adapter)
            if backend.sampling.temperature != FAULT_TEMPERATURE and adapter.version > _after() and _turned():
                backend.sampling = dataclasses.replace(backend.sampling, temperature=FAULT_TEMPERATURE)
                get_logger("faulty_worker").warning("fault_started", fault="temperature", version=adapter.version)

        backend.add_adapter = add_then_turn
        return backend

    worker.make_backend = make_backend


INJECT = {"base_model": inject_base_model, "stale_lora_id": inject_stale_lora_id,
          "swapped_files": inject_swapped_files, "temperature": inject_temperature}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in FAULTS:
        print(f"usage: python -m tests.integrity.faulty_worker {{{','.join(FAULTS)}}} [worker args]", file=sys.stderr)
        return 2
    INJECT[argv[0]]()
    import loraflow.rollout_worker.worker  # noqa: F401  (the imports a start costs, done before the gate)
    from loraflow.rollout_worker.main import main as worker_main
    from tests.integrity import gate

    gate.wait()
    return worker_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
