# The two commands a fresh machine needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo test test-fast lint layout golden bench bench-quick bench-peers fuzz clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -qq --upgrade pip
	$(BIN)/python -m pip install -qq -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(BIN)/ovshard demo

lint: setup
	$(BIN)/ruff check .

# module sizes and docstrings (.ci/check_sizes.py), import-linter (the layering contracts in .importlinter)
# and mypy, on the package as installed
layout: setup
	BIN=$(BIN) .ci/check-layout

# --durations: the slowest tests at the end of the log, where the suite's 20 minutes go
test: lint layout
	$(BIN)/python -m pytest -q -W ignore::DeprecationWarning --durations=25

# the inner loop: everything but the tests marked slow, e2e or cluster (pyproject.toml), in a few minutes
test-fast: setup
	$(BIN)/python -m pytest -q -W ignore::DeprecationWarning -m "not slow and not e2e and not cluster"

golden: setup
	$(BIN)/python -m pytest -q tests/compiler/test_golden.py tests/e2e/test_demo.py --update-golden

# the suites (bench/suites.py; `bench/suite.py --list` prints them, bench/README.md says what each measures),
# between the lines of the scripts with their own
bench: setup
	$(BIN)/python bench/compile_memory.py --stages 2,4 --monolithic
	CI=true $(BIN)/python bench/suite.py --suite compile  # the compiler's fixed cost per piece (stories260K, default and fp32)
	$(BIN)/python bench/compile_memory.py --sweep  # anon memory vs layers per stage; ~30 GB in /tmp/ovshard-sweep
	CI=true $(BIN)/python bench/suite.py --suite runtime,api,cluster  # the scenarios; ovshard api under load; up: placement, a node lost
	CI=true $(BIN)/python bench/int4_frontier.py --llama-cpp --texts apache-2.0,story,code,dialogue  # weight formats on real models, llama.cpp's beside: bits, perplexity on four kinds of text, compile memory
	$(BIN)/python bench/int4_fit_cost.py --rounds 3  # the default (calibrated) INT4 compile against data-free, per layer, A/B interleaved
	CI=true $(BIN)/python bench/compile/nncf_options.py  # NNCF's own options (data-free and data-aware) on the real Gemma 3 270M
	CI=true $(BIN)/python bench/compile/nncf_formats.py  # NNCF's other 4-bit formats (NF4, CB4, MXFP4) on SmolLM2-135M: perplexity
	$(BIN)/python bench/compile_memory.py --sweep --cases 30b-a3b --resume  # compile memory and time per layer with 128 experts a layer
	$(BIN)/python bench/compile_memory.py --sweep --cases moe-new --resume --drop-checkpoints  # the same, flat in layers, for GLM-4.5-Air, Llama-4-Scout and DeepSeek-V3 with fewer experts
	CI=true $(BIN)/python bench/suite.py --suite kernels,batching  # the MoE step, weight formats' decode speed; paged batching and its ceilings

# smoke runs of every suite's scripts that have a quick mode, on stories260K (a few minutes)
bench-quick: setup
	CI=true $(BIN)/python bench/suite.py --suite runtime,compile,batching,kernels,cluster,api,peers --quick

# ovshard against llama.cpp (built once from the llama-cpp-python sdist into ~/.cache/ovshard/peers; needs cmake, g++):
# peers.py, spec_copy.py, decode_overhead.py, ttft.py, server_peers.py, then api_load.py on the Gemma bundle
# server_peers.py compiled (bench/suites.py's peers suite)
bench-peers: setup
	CI=true $(BIN)/python bench/suite.py --suite peers

# a real worker under 1,000,000 hostile frames; --workers (default: one client process per core but one) scales it
fuzz: setup
	$(BIN)/python tests/fuzz_worker.py --frames 1000000
	$(BIN)/python tests/batch_fuzz.py --frames 1000000

clean:
	rm -rf out bench/results build .pytest_cache .ruff_cache .mypy_cache
