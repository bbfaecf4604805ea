# Set-up and entry points. `make run` = set up + the main job; `make test` = set up + tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# llama.cpp build flags. CPU default: no native build (ggml's AMX path crashes on quantised
# models on the CPU machines we run on); AVX-512 only where this CPU has it (a build with it
# dies with an illegal instruction elsewhere). GPU machines: make setup LLAMA_CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF" EXTRAS=qwen05b,gpu
AVX512 := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo ON || echo OFF)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=$(AVX512) -DLLAVA_BUILD=OFF
EXTRAS ?= qwen05b
PYTEST_ARGS ?=

.PHONY: setup run test clean-venv compress-results

setup: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# --no-cache-dir: pip would reuse a cached wheel built with other CMAKE_ARGS
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --no-cache-dir "llama-cpp-python==0.3.36"
	$(BIN)/pip install -e ".[$(EXTRAS)]"
	touch $@

run: setup
	$(BIN)/harness run

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)

# gzip the plain .json / .npy under docs/results (deterministic; docs/results/README.md); no venv needed
compress-results:
	$(PY) -m harness.jsonio --compress docs/results
