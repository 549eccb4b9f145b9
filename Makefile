# Everything builds from nothing: `make test` and `make demo` create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
# Users who bring their own torch (a CUDA build, say) override this: make test TORCH_SPEC=torch==2.5.1
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test demo bench lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml plugins/tiered-ckpt-faults/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	$(BIN)/pip install --quiet -e plugins/tiered-ckpt-faults
	touch $(STAMP)

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests plugins/tiered-ckpt-faults/tests

demo: venv
	$(BIN)/tiered-ckpt demo

bench: venv
	$(BIN)/python benchmarks/run_all.py

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
