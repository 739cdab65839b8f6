# Two entry points: `make demo` (the main job) and `make test` (the CPU suite).
# Both create and use the project venv by themselves.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU wheel; a venv that already has torch >= 2.5 keeps its own.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed
DEPS   := setup.py Makefile $(wildcard csrc/*.cpp csrc/*.h)

.PHONY: demo test install clean bench bench-quick

$(STAMP): $(DEPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 5))" \
		|| $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q pybind11 ninja
	$(PY) -m pip install -q --no-build-isolation -e ".[test,plots]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m kforcing_kernels.demo

test: $(STAMP)
	$(PY) -m pytest python_tests -q -rs -p no:cacheprovider

bench: $(STAMP)
	$(PY) bench/attention.py

bench-quick: $(STAMP)
	$(PY) -m bench attention --quick

# Plants each bug of tools/mutations.py in a scratch copy and runs the tests that must catch it (slow; not part of test).
.PHONY: mutate
mutate: $(STAMP)
	nice -n 5 $(PY) tools/mutate.py

clean:
	rm -rf $(VENV) build *.egg-info kforcing_kernels/*.so
