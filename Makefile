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

.PHONY: demo test install clean bench bench-quick

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
	$(PY) -m kforcing_kernels.demo

test: $(STAMP)
	$(PY) -m pytest python_tests -q -p no:cacheprovider

bench: $(STAMP)
	$(PY) bench/attention.py

bench-quick: $(STAMP)
	$(PY) -m bench attention --quick

clean:
	rm -rf $(VENV) build dist *.egg-info kforcing_kernels/*.so
