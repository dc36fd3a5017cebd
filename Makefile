# hpc-elastic — the two commands of the README:
#   make demo   set everything up on a fresh Debian 12 machine, bring the local Slurm cluster up, run the demo
#   make test   set everything up and run all tests (unit + integration against the local cluster) and lint
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python

# What the demo needs of the package: training (torch), the daemon's metrics, the plot; no Horovod, MPI or dev tools.
DEMO_EXTRAS := torch,metrics,plot
TIMINGS := demo-timings.txt

.PHONY: setup cluster demo test unit integration lint bench down

setup:
	scripts/install-deps
	scripts/build-horovod

cluster: setup
	scripts/dev-cluster up

# Every setup phase is timed (scripts/timed; install-deps times its own phases) and summed up at the end.
demo:
	@rm -f $(TIMINGS); \
	export HPC_ELASTIC_T0=$$(date +%s.%N) HPC_ELASTIC_TIMINGS=$$PWD/$(TIMINGS); \
	scripts/timed install-deps scripts/install-deps --extras $(DEMO_EXTRAS) \
	  && scripts/timed "cluster up" scripts/dev-cluster up \
	  && scripts/timed --first-line demo $(PY) scripts/demo.py \
	  && $(PY) -m hpc_elastic cluster status; \
	status=$$?; \
	echo "== setup phases and demo (seconds)"; \
	awk -F'|' '{ printf "  %-48s %8s\n", $$1, $$2 }' $(TIMINGS); \
	exit $$status

# Two lanes at once (scripts/test-lanes): the integration tests beside the unit tests. pytest exits 5 when nothing
# is collected; that is not a failure of the suite.
test: lint cluster
	HPC_ELASTIC_REQUIRE_CLUSTER=1 HPC_ELASTIC_REQUIRE_HOROVOD=1 scripts/test-lanes $(PY)

unit: setup
	$(PY) -m pytest -m "not integration" || [ $$? -eq 5 ]

integration: cluster
	HPC_ELASTIC_REQUIRE_CLUSTER=1 $(PY) -m pytest -m integration || [ $$? -eq 5 ]

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: setup
	@set -e; for b in bench/*.py; do [ -e "$$b" ] || continue; echo "== $$b"; $(PY) "$$b"; done

down:
	scripts/dev-cluster down
