# The two commands a fresh machine needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: setup demo test test-fast lint layout golden bench bench-peers fuzz clean

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

test: lint layout
	$(BIN)/python -m pytest -q -W ignore::DeprecationWarning

# the inner loop: everything but the tests marked slow, e2e or cluster (pyproject.toml), in a few minutes
test-fast: setup
	$(BIN)/python -m pytest -q -W ignore::DeprecationWarning -m "not slow and not e2e and not cluster"

golden: setup
	$(BIN)/python -m pytest -q tests/compiler/test_golden.py tests/e2e/test_demo.py --update-golden

bench: setup
	$(BIN)/python bench/compile_memory.py --stages 2,4 --monolithic
	CI=true $(BIN)/python bench/compile_overhead.py --rounds 3  # the compiler's fixed cost per piece (stories260K, default and fp32)
	$(BIN)/python bench/compile_memory.py --sweep  # anon memory vs layers per stage; ~30 GB in /tmp/ovshard-sweep
	CI=true $(BIN)/python bench/suite.py
	$(BIN)/python bench/api_load.py --models stories260K,llama-3.2-1b --requests 2  # ovshard api at 1-8 clients vs the bare Session
	$(BIN)/python bench/placement.py --rounds 3  # ovshard up: measured placement vs equal split on an emulated unequal pair
	$(BIN)/python bench/node_loss.py --rounds 2  # ovshard up: a node lost for good mid-stream -> every stream progressing again
	CI=true $(BIN)/python bench/int4_frontier.py --llama-cpp --texts apache-2.0,story,code,dialogue  # weight formats on real models, llama.cpp's beside: bits, perplexity on four kinds of text, compile memory
	$(BIN)/python bench/int4_fit_cost.py --rounds 3  # the default (calibrated) INT4 compile against data-free, per layer, A/B interleaved
	CI=true $(BIN)/python bench/nncf_options.py  # NNCF's own options (data-free and data-aware) on the real Gemma 3 270M
	CI=true $(BIN)/python bench/nncf_formats.py  # NNCF's other 4-bit formats (NF4, CB4, MXFP4) on SmolLM2-135M: perplexity
	$(BIN)/python bench/moe_step.py --out /tmp/ovshard-bench/moe-step  # a Qwen3-30B-A3B-shaped stage cut to 4 layers against a dense stage of its active parameters
	$(BIN)/python bench/compile_memory.py --sweep --cases 30b-a3b --resume  # compile memory and time per layer with 128 experts a layer
	CI=true $(BIN)/python bench/int4_kernels.py  # decode speed of weight formats on the 1B shape (INT4 sym/asym, groups, INT8 share)
	$(BIN)/python bench/paged_batch.py  # S sequences in one paged inference against S stateful streams
	CI=true $(BIN)/python bench/tick_cost.py  # a paged tick's compute against its sequences: the ceilings of batching

# ovshard against llama.cpp (built once from the llama-cpp-python sdist into ~/.cache/ovshard/peers; needs cmake, g++)
bench-peers: setup
	$(BIN)/python bench/peers.py --models smollm2-135m,llama-3.2-1b,gemma3-270m,stories260K --threads 2  # one node against the fastest llama.cpp that runs here
	$(BIN)/python bench/spec_copy.py  # prompt lookup on copy-style tasks, the real Gemma's INT4 bundle: speed-up, speculative == plain
	$(BIN)/python bench/decode_overhead.py --rounds 4  # the decode-step profile and CPU plugin settings (Gemma 3 270M)
	$(BIN)/python bench/ttft.py  # time to the first token, cold and warm, against llama-completion
	$(BIN)/python bench/server_peers.py --tokens 128  # 8 chat clients: ovshard api against llama-server -np 8
	# the same Gemma bundle (compiled by server_peers.py): 8 openai clients at once against one, through ovshard api
	$(BIN)/python bench/api_load.py --bundle /tmp/ovshard-bench/bundles/gemma3-270m-q4km-2st-default --clients 1,8 --requests 2 --tokens 64 --rounds 3

# a real worker under 1,000,000 hostile frames; --workers (default: one client process per core but one) scales it
fuzz: setup
	$(BIN)/python tests/fuzz_worker.py --frames 1000000
	$(BIN)/python tests/batch_fuzz.py --frames 1000000

clean:
	rm -rf out bench/results build .pytest_cache .ruff_cache .mypy_cache
