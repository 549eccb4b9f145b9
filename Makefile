# Everything builds from nothing: `make test` and `make demo` create .venv and install what they need.
PYTHON ?= python3
VENV ?= .venv
# Users who bring their own torch (a CUDA build, say) override this: make test TORCH_SPEC=torch==2.5.1
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# `make lowest`: a second venv with every declared lower bound installed exactly (.ci/lower_bounds.py reads them
# from pyproject.toml), torch's floor first and on its own, and a smoke subset run in it. The package index has
# torch 2.5.1 only as a CUDA build (about 3.5 GB to download, 5 GB installed; it runs on the CPU): the price of
# testing the floor we declare.
LOWEST_VENV ?= .venv-lowest
LOWEST_BIN := $(LOWEST_VENV)/bin
LOWEST_TORCH_SPEC ?= $(shell $(PYTHON) .ci/lower_bounds.py --torch)
LOWEST_TESTS ?= tests/test_config.py tests/test_checksum.py tests/test_compression.py tests/test_flat_codec.py \
	tests/test_plugins.py tests/test_cli.py tests/test_cli_first_hour.py tests/test_s3.py \
	plugins/tiered-ckpt-faults/tests/test_faults.py

.PHONY: venv test demo bench lint lowest clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py tiered_ckpt/_streamcopy.c plugins/tiered-ckpt-faults/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test,dev]"
	$(BIN)/pip install --quiet -e plugins/tiered-ckpt-faults
	touch $(STAMP)

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=25 tests plugins/tiered-ckpt-faults/tests

demo: venv
	$(BIN)/tiered-ckpt demo

# `make bench BENCH_ARGS="--quick"` (or --sections peers,layouts,s3,scale, --states ...): see benchmarks/README.md
bench: venv $(VENV)/.bench-installed
	$(BIN)/python benchmarks/run_all.py $(BENCH_ARGS)

$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/pip install --quiet -e ".[bench]"
	touch $@

lint: venv
	$(BIN)/ruff check .

lowest:
	rm -rf $(LOWEST_VENV)
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_BIN)/pip install --quiet --upgrade pip
	$(LOWEST_BIN)/pip install --quiet "$(LOWEST_TORCH_SPEC)"
	$(PYTHON) .ci/lower_bounds.py > $(LOWEST_VENV)/lower-bounds.txt
	$(LOWEST_BIN)/pip install --quiet -r $(LOWEST_VENV)/lower-bounds.txt
	$(LOWEST_BIN)/pip install --quiet --no-deps -e . -e plugins/tiered-ckpt-faults
	$(LOWEST_BIN)/pip check
	$(LOWEST_BIN)/python -m pytest -q -p no:cacheprovider $(LOWEST_TESTS)

clean:
	rm -rf $(VENV) $(LOWEST_VENV) build *.egg-info tiered_ckpt/_streamcopy*.so
