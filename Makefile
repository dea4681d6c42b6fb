# Two commands on a fresh machine with Python 3.11 and make: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

# The newest releases pip resolves, tested on Python 3.12: python3.12 where it runs, else pyenv's.
PYTHON_LATEST ?= $(shell for p in python3.12 "$$(pyenv prefix 3.12 2>/dev/null)/bin/python"; do \
	"$$p" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null && { echo "$$p"; break; }; done)
VENV_LATEST := .venv-latest
STAMP_LATEST := $(VENV_LATEST)/.installed

.PHONY: demo test test-latest bench bench-planner bench-pipeline bench-ray bench-suite bench-fuzz bench-grad bench-costmodel bench-pricers bench-remat lint

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test,clients]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python examples/gpt.py

# Two pytest workers: one alone keeps a 2-core machine about 60% busy. Tests marked xdist_group
# share a worker, so one local Ray instance runs at a time. The run's tests share a fresh XLA
# compilation cache (many compile the same programs), removed when they end.
define run_suite
	cache=$$(mktemp -d) && JAX_COMPILATION_CACHE_DIR=$$cache \
	JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0 \
	$(1)/bin/pytest -q -n 2 --dist loadgroup --durations=20; rc=$$?; rm -rf "$$cache"; exit $$rc
endef

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(call run_suite,$(VENV))

$(STAMP_LATEST): pyproject.toml
	$(PYTHON_LATEST) -m venv $(VENV_LATEST)
	$(VENV_LATEST)/bin/pip install -q --upgrade pip
	$(VENV_LATEST)/bin/pip install -q --upgrade -e ".[test,clients]"
	touch $(STAMP_LATEST)

# The suite again on the newest jax, PuLP and numpy (the oldest are `make test`'s); skipped,
# saying so, where no Python 3.12 is installed.
test-latest:
ifeq ($(PYTHON_LATEST),)
	@echo "test-latest skipped: no Python 3.12 interpreter (python3.12 or pyenv's 3.12)"
else
	$(MAKE) --no-print-directory $(STAMP_LATEST)
	$(VENV_LATEST)/bin/python -c "import jax, pulp, numpy; print('jax', jax.__version__, \
	'pulp', pulp.__version__, 'numpy', numpy.__version__)"
	$(call run_suite,$(VENV_LATEST))
endif

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/methods.py

bench-planner: $(STAMP)
	$(VENV)/bin/python benchmarks/planning_time.py
	$(VENV)/bin/python benchmarks/plan_quality.py

bench-pipeline: $(STAMP)
	$(VENV)/bin/python benchmarks/pipeshard_planning.py

bench-ray: $(STAMP)
	$(VENV)/bin/python benchmarks/ray_pipeline.py

bench-suite: $(STAMP)
	$(VENV)/bin/python benchmarks/run.py

bench-grad: $(STAMP)
	$(VENV)/bin/python benchmarks/grad_accumulation.py

bench-fuzz: $(STAMP)
	$(VENV)/bin/python benchmarks/fuzz.py --cases 300

bench-costmodel: $(STAMP)
	$(VENV)/bin/python benchmarks/cost_model.py

# How DP/ZeRO are priced: jax.grad against autopar.grad steps, explain's rows against the methods.
bench-pricers: $(STAMP)
	$(VENV)/bin/python benchmarks/found_gradients.py
	$(VENV)/bin/python benchmarks/pricers.py

# Recomputation against XLA's memory analysis on one device (meant for a GPU: JAX_PLATFORMS=cuda).
bench-remat: $(STAMP)
	$(VENV)/bin/python benchmarks/remat_memory.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
