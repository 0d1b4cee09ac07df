# Every target that needs Python creates .venv and installs on first use (a line per step; the
# whole output goes to .venv/install.log); a no-op afterwards. `make test` also installs the
# Debian packages its tests drive: chromium and postgresql (tools/install.sh system).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export RAY_USAGE_STATS_ENABLED := 0

PREFECT_HOST ?= 127.0.0.1
PREFECT_PORT ?= 4200
API_URL := http://$(PREFECT_HOST):$(PREFECT_PORT)/api

.PHONY: install system test lint run clean server worker deploy serve bench chaos adversary adversary-mutations

$(STAMP): pyproject.toml
	@PYTHON=$(PYTHON) tools/install.sh venv
	@touch $(STAMP)

install: $(STAMP)

system:
	@tools/install.sh system

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Three phases on 2 cores (tools/test.sh): the multi-node tests beside the e2e, tracking and
# object-storage modules, the rest on 2 xdist processes (a module whole to each), the step-time
# module alone. TEST_ARGS goes to each pytest call.
test: $(STAMP) system lint
	tools/test.sh $(TEST_ARGS)

run: $(STAMP)
	$(VENV)/bin/relaytrain run --config examples/digits_cnn.yaml

# Every benchmark in full, one process tree each (bench/README.md; about 105 min on 2 cores: run it
# on a quiet machine), then the tables of bench/README.md. BENCH_ARGS goes to each benchmark.
BENCHMARKS := overhead recovery checkpoints fsdp_checkpoints restore reporting scaling memory precision data elastic workloads datasets queue sweep
bench: $(STAMP)
	status=0; for name in $(BENCHMARKS); do \
		$(PY) -m bench.$$name $(BENCH_ARGS) || status=1; \
	done; \
	$(PY) -m bench && exit $$status

# The chaos campaign (bench/chaos.py): about 10 minutes of training under 24 faults of every kind,
# after an uninterrupted run of the same spec; about 30 min in all. Its result goes beside the
# others (CHAOS_ARGS: --seed N, --faults N, --mean-gap-s S).
chaos: $(STAMP)
	$(PY) -m bench.chaos $(CHAOS_ARGS) && $(PY) -m bench

# The seeded adversary (tools/adversary.py, tests/adversary/): scenarios of real use, faults and
# damage drawn from consecutive seeds for about 30 minutes, each judged by oracles of its own; the
# result in bench/results/<date>-adversary.json (ADVERSARY_ARGS: --minutes M, --first-seed N,
# --shrink; --seed N replays one).
adversary: $(STAMP)
	$(PY) -m tools.adversary $(ADVERSARY_ARGS)

# The adversary's mutation check (tools/adversary_mutations.py): each fix it found reversed on a
# scratch worktree of HEAD (bench/mutations/*.diff) and the seeds that found it replayed there;
# each reverse must fail. The result in bench/results/<date>-adversary-mutations.json.
adversary-mutations: $(STAMP)
	$(PY) -m tools.adversary_mutations

# A Prefect server with its UI on http://127.0.0.1:4200 (SQLite under ~/.prefect by default;
# PostgreSQL with PREFECT_SERVER_DATABASE_CONNECTION_URL=postgresql+asyncpg://user:pw@host/db).
server: $(STAMP)
	$(VENV)/bin/prefect server start --host $(PREFECT_HOST) --port $(PREFECT_PORT)

# Register the deployments of deployments/prefect.yaml on the server.
deploy: $(STAMP)
	PREFECT_API_URL=$(API_URL) $(VENV)/bin/prefect work-pool create relaytrain-process --type process --overwrite
	PREFECT_API_URL=$(API_URL) $(VENV)/bin/prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml

# A process worker that runs them (any `prefect worker start --pool relaytrain-process` from this
# venv does: each flow run starts in the checkout that `make deploy` ran in).
worker: $(STAMP)
	PREFECT_API_URL=$(API_URL) $(VENV)/bin/prefect worker start --pool relaytrain-process --type process

# Or serve both deployments from one process, with no work pool.
serve: $(STAMP)
	PREFECT_API_URL=$(API_URL) $(PY) -m deployments.serve

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
