# tilefuse: `make test` runs the suite, `make train` trains the example transformer.
# Every target makes .venv itself when it is missing, and reinstalls only when pyproject.toml
# changed since the last install (the stamp file records that install).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.tilefuse-installed
EXTRAS ?= test,train
PYTEST_ARGS ?= -n 2
TRAIN_ARGS ?=

.PHONY: test train bench fuzz install clean

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) tests

# The end-to-end example; until it exists, a short demo of jit on the default device.
train: $(STAMP)
	@if [ -f examples/train_transformer.py ]; then \
		$(PY) examples/train_transformer.py $(TRAIN_ARGS); \
	else \
		$(PY) -c 'import numpy as np, tilefuse as tx, tilefuse.numpy as tnp; \
f = tx.jit(lambda w, x: tnp.tanh(x @ w).sum()); \
w, x = np.ones((4, 2), np.float32), np.ones((3, 4), np.float32); \
print(tx.make_graph(lambda w, x: tnp.tanh(x @ w).sum())(w, x)); \
print("result", float(f(w, x)), "on", tx.default_device())'; \
	fi

bench: $(STAMP)
	@set -e; for f in benchmarks/bench_*.py; do \
		[ -f "$$f" ] || continue; echo "== $$f"; $(PY) "$$f"; \
	done

# The fuzz tests (tests/fuzz) with a large budget: TILEFUSE_FUZZ_EXAMPLES scales every test's
# example count (1 in `make test`). A failure prints the shrunk program to keep as a regression.
FUZZ_EXAMPLES ?= 40
fuzz: $(STAMP)
	TILEFUSE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest $(PYTEST_ARGS) tests/fuzz \
		--hypothesis-show-statistics

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
