# Two commands on a fresh machine: `make demo` (set up, run the main job) and `make test`.
# Python 3.12 runs the project; a separate Python 3.11 venv holds the CPU torch + transformers
# reference that the tests compare against.
export PYENV_VERSION ?= 3.12.1:3.11.7
PY312 ?= python3.12
PY311 ?= python3.11
VENV := .venv
REF := .venv-ref
PIP_FLAGS := -q --disable-pip-version-check

.PHONY: setup demo test clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PY312) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) --upgrade pip
	$(VENV)/bin/pip install $(PIP_FLAGS) -c constraints.txt -e '.[dev]'
	touch $@

$(REF)/.installed: tests/requirements-ref.txt
	$(PY311) -m venv $(REF)
	$(REF)/bin/pip install $(PIP_FLAGS) -r tests/requirements-ref.txt
	touch $@

setup: $(VENV)/.installed $(REF)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/python experiments/quickstart.py

# XLA's CPU compile, not the run, dominates most tests; LLVM's backend optimizations off cut the
# suite's CPU time by about a quarter (measured) and do not change results (every test compares
# programs compiled the same way, or with a reference tolerance). The demo keeps the default.
# Many tests compile the same programs in several processes (xdist workers, the 8-device and
# kill/resume children, experiment workers): JAX's persistent compilation cache, fresh per run,
# lets them share compilations (programs compiled in > 0.5 s).
TEST_CACHE := $(shell mktemp -d -u /tmp/fp8rl-jax-cache.XXXXXX)
test: $(VENV)/.installed $(REF)/.installed
	XLA_FLAGS="$(XLA_FLAGS) --xla_backend_optimization_level=0" FP8RL_REF_PYTHON=$(abspath $(REF))/bin/python \
		JAX_COMPILATION_CACHE_DIR=$(TEST_CACHE) JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5 \
		$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile tests; status=$$?; rm -rf $(TEST_CACHE); exit $$status

clean:
	rm -rf $(VENV) $(REF) runs
