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

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

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
