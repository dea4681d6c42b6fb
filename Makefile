# Two commands on a fresh machine with Python 3.11 and make: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test bench bench-planner bench-pipeline bench-ray bench-suite bench-fuzz bench-grad bench-costmodel bench-remat lint

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e ".[test,clients]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python examples/gpt.py

# Two pytest workers: one alone keeps a 2-core machine about 60% busy. Tests marked xdist_group
# share a worker, so one local Ray instance runs at a time.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q -n 2 --dist loadgroup --durations=20

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

# Recomputation against XLA's memory analysis on one device (meant for a GPU: JAX_PLATFORMS=cuda).
bench-remat: $(STAMP)
	$(VENV)/bin/python benchmarks/remat_memory.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
