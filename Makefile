# The words people type. `make demo` and `make test` do all the set-up on a
# fresh clone: they create .venv and install mqds into it.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# Tests that start processes use loopback ports; PYTEST_ARGS narrows a run.
PYTEST_ARGS ?=
# The long fault-injection run; override with CHAOS_ARGS="--duration 600 --seed 7".
# --disk journal: every node's data directory on a fault filesystem (root and FUSE), so the mix has the disk nemeses.
CHAOS_ARGS ?= --duration 1800 --nodes 5 --nemesis mix --disk journal --report-json chaos-report.json

.PHONY: help install generate fuse-libs lint test test-fast test-unit test-integration test-spark chaos proto bench-storage bench-cluster bench-peer bench-spark demo server cluster clean

help:
	@echo "make demo            set up, start a local 3-node cluster, publish, kill a leader, replay, check, stop"
	@echo "make test            set up, lint (ruff, mypy), check generated code, run the tests"
	@echo "make test-fast       a quick check (under 2 minutes): ruff and the tests not marked integration, spark, chaos or slow"
	@echo "make test-unit       the tests not marked integration, spark or chaos (no cluster processes), slow ones too"
	@echo "make test-integration  the tests marked integration: real mqds-server processes on loopback"
	@echo "make lint            ruff and mypy only"
	@echo "make bench-storage   storage-layer benchmark: 1,000,000 messages vs raw rocksdict"
	@echo "make bench-cluster   replicated writes: 3 nodes x 3 replicas vs 1 node, failover time"
	@echo "make bench-peer      the small-write scenarios and the peer (NATS JetStream) alternating, with their ratios"
	@echo "make bench-spark     Spark connector: 1,000,000 stored messages read into Spark vs the client's replay"
	@echo "make test-spark      only the Spark connector tests (local[2] Spark against a real 3-node cluster)"
	@echo "make server          run one node in the foreground on 127.0.0.1:7101 (data in ./data/n1)"
	@echo "make cluster         start a local 3-node cluster in the background on 127.0.0.1:7101-7103 (data in ./data/cluster)"
	@echo "make proto           regenerate client/mqds/v1 from proto/"
	@echo "make chaos           the long fault-injection run: 30 min, 5 nodes, every nemesis, disk faults too (CHAOS_ARGS=...)"
	@echo "make test-deploy     the deployment tests: Dockerfile, compose and k8s/ manifests, run and validated offline"
	@echo "make image           docker build -f deploy/Dockerfile -t mqds:0.1.0 . (needs a Docker engine)"
	@echo "make clean           remove .venv and caches"

# The packages, each a distribution of its own (docs/development.md, "Layout"): the client library, the
# command line, the broker integrations, the Spark source, the node (the root), and the development
# tools, chaos runner and benchmarks; all installed editable into .venv.
PACKAGES := ./client ./cli ./broker ./spark '.[dev]' ./tools ./chaos './bench[spark]'

$(STAMP): pyproject.toml setup.py client/pyproject.toml client/setup.py cli/pyproject.toml broker/pyproject.toml \
         spark/pyproject.toml tools/pyproject.toml chaos/pyproject.toml bench/pyproject.toml \
         server/mqds/server/_wire_native.c \
         server/mqds/server/storage/_store_native.c client/mqds/client/core/_wire_columns.c \
         client/mqds/client/core/_store_frames.c | fuse-libs
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(addprefix -e ,$(PACKAGES))
	touch $(STAMP)

install: $(STAMP) generate

# The synchronous client's API modules are generated from the asyncio client's (client/generate_sync.py;
# git ignores them): written before anything runs, so an edit of client/mqds/client/aio/ takes effect.
generate: $(STAMP)
	@$(BIN)/python client/generate_sync.py

# The chaos suite's fault filesystem (mqds.chaos.faultfs) needs libfuse 3 and fusermount3 from Debian's
# fuse3 and libfuse3-3: installed here when missing and make runs as root with apt-get. Anywhere else this
# only says so, and the fault filesystem's tests are skipped with the reason.
fuse-libs:
	@if $(PYTHON) -c "import ctypes.util, sys; sys.exit(not ctypes.util.find_library('fuse3'))" \
	    && command -v fusermount3 >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing fuse3 and libfuse3-3 (the chaos suite's fault filesystem)"; \
	    export DEBIAN_FRONTEND=noninteractive; \
	    { apt-get install -y -q fuse3 libfuse3-3 >/dev/null 2>&1 \
	      || { apt-get update -q >/dev/null && apt-get install -y -q fuse3 libfuse3-3 >/dev/null; }; } \
	    || echo "could not install fuse3 and libfuse3-3: the fault filesystem's tests will be skipped"; \
	else \
	    echo "libfuse 3 is missing (apt-get install fuse3 libfuse3-3): the fault filesystem's tests will be skipped"; \
	fi

SOURCES := client cli broker spark server tools chaos bench

lint: $(STAMP) generate
	$(BIN)/ruff check $(SOURCES) tests proto
	$(BIN)/ruff format --check $(SOURCES) tests proto
	$(BIN)/mypy -p mqds.protocol -p mqds.client -p mqds.server -p mqds.cli -p mqds.broker -p mqds.chaos -p mqds.tools -p mqds.spark -p mqds.bench

# The Spark tests first, in a process of their own (Spark's JVM must start
# before any gRPC channel of the process). Then three workers, each running whole test files (a file's cluster fixture and its
# tests stay together); most of what the tests wait for is elections, fsyncs
# and timeouts, so three files at a time fit on two cores.
test: lint
	$(BIN)/python proto/generate.py --check
	$(BIN)/python -m pytest -m spark $(PYTEST_ARGS)
	$(BIN)/python -m pytest -m "not chaos and not spark" -n 3 --dist loadfile $(PYTEST_ARGS)

# A quick check while working: ruff, and every test not marked integration, spark, chaos or slow (no
# cluster processes), on three workers. make test runs all of them and more.
test-fast: $(STAMP) generate
	$(BIN)/ruff check $(SOURCES) tests proto
	$(BIN)/python -m pytest -m "not integration and not spark and not chaos and not slow" -n 3 -q $(PYTEST_ARGS)

# The tiers are markers, not folders: a package's folder under tests/ holds its unit and its integration
# tests together (docs/development.md, "Layout"). Unit: no cluster processes, no Spark, slow ones included.
test-unit: $(STAMP) generate
	$(BIN)/python -m pytest -m "not integration and not spark and not chaos" $(PYTEST_ARGS)

# Real mqds-server processes on loopback (the marker integration), the Spark tests with a cluster included.
test-integration: $(STAMP) generate
	$(BIN)/python -m pytest -m integration $(PYTEST_ARGS)

# The Spark connector's tests alone (they are part of make test too): one
# local[2] Spark session shared by all of them, one 3-node cluster.
test-spark: $(STAMP) generate
	$(BIN)/python -m pytest -m spark $(PYTEST_ARGS)

# The long chaos run (python -m mqds.chaos --help for the options); run as root
# for real network partitions. The short run is part of make test.
chaos: $(STAMP) generate
	$(BIN)/python -m mqds.chaos $(CHAOS_ARGS)

# deploy/ and k8s/: manifests validated offline, and their commands run as local processes.
.PHONY: test-deploy image
test-deploy: $(STAMP) generate
	$(BIN)/python -m pytest tests/deploy $(PYTEST_ARGS)

image:
	docker build -f deploy/Dockerfile -t mqds:0.1.0 .

proto: $(STAMP)
	$(BIN)/python proto/generate.py

bench-storage: $(STAMP) generate
	$(BIN)/python -m mqds.server.storage.bench

bench-cluster: $(STAMP) generate
	$(BIN)/python -m mqds.bench.cluster

# The peer's scripts (jetstream_bench.py, setup.sh): the anchors directory; its setup.sh installs the peer once per
# machine under $$ANCHORS. BENCH_PEER_ARGS="--duration 3 --peer-args '--n 30000 --n-sync 1000'" for a short sitting.
PEER_ANCHORS ?= ../shared/anchors
BENCH_PEER_ARGS ?=
bench-peer: $(STAMP) generate
	$(BIN)/mqds bench --start-cluster --small-writes --peer-anchors $(PEER_ANCHORS) $(BENCH_PEER_ARGS)

bench-spark: $(STAMP) generate
	$(BIN)/python -m mqds.bench.spark

server: $(STAMP) generate
	$(BIN)/mqds-server --node-id n1 --listen 127.0.0.1:7101 --data-dir data/n1

# Stop it with: .venv/bin/mqds cluster down --data-dir data/cluster
cluster: $(STAMP) generate
	$(BIN)/mqds cluster up --data-dir data/cluster

demo: $(STAMP) generate
	$(BIN)/python -m mqds.tools.demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
