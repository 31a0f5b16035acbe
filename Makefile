# The README's two commands: `make demo` and `make test`. Both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
DEMO_OUT := runs/quickstart
UI_PORT ?= 5000

.PHONY: demo test lint bench ui clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,fx,hf,kernels]'
	$(BIN)/python -m simulators.analytical.warm
	rm -f $(VENV)/.installed-* && touch $@

demo: $(STAMP)
	$(BIN)/dse run studies/quickstart.yaml --out $(DEMO_OUT)

# Two pytest-xdist workers, each taking a whole test file at a time (its module fixtures built once). Run alone, the
# suite kept one core of two busy on average (25.8 min wall for 26.3 min of CPU): on a 2-core machine it passed in
# 17.9 minutes on two workers against 24.5-25.5 alone (2026-11-30, a fresh clone). TEST_WORKERS=0 runs it in pytest's
# own process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	for script in benchmarks/*.py; do $(BIN)/python $$script || exit 1; done

# `dse ui` runs the MLflow UI in a process group of its own and stops all of it on Ctrl-C or SIGTERM, which make
# passes on to its recipe (plain `mlflow ui` left its workers running).
ui: $(STAMP)
	exec $(BIN)/dse ui $(DEMO_OUT) --port $(UI_PORT)

clean:
	rm -rf $(VENV) runs
