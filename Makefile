# mesh: two commands on a fresh machine with only python3:  make demo  /  make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# the demo needs the product and openai (mesh up), not the test tools nor the plotting stack: its own, smaller install
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: demo test test-unit test-e2e test-bench soak bench bench-http report venv clean valkey-server

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[demo]'
	touch $(DEMO_STAMP)

venv: $(STAMP)

# a venv made by `make test` (.[dev] holds .[lab]) serves the demo as it is
demo: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
	$(VENV)/bin/mesh up

# redis-server (Valkey's protocol) for the indexer's Valkey backend tests: installed from the system's
# package manager when missing and we may (root with apt-get); the tests then must run, not skip
valkey-server:
	@if ! command -v valkey-server >/dev/null 2>&1 && ! command -v redis-server >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing redis-server (apt-get) for the Valkey backend tests"; \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null 2>&1 || \
			{ apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server >/dev/null 2>&1; } || \
			echo "redis-server could not be installed: the Valkey backend tests will be skipped"; \
		else echo "no valkey-server/redis-server and no root apt-get: the Valkey backend tests will be skipped"; fi; fi

HAVE_VALKEY = $$(command -v valkey-server >/dev/null 2>&1 || command -v redis-server >/dev/null 2>&1 && echo 1 || echo 0)

test: $(STAMP) valkey-server
	MESH_REQUIRE_VALKEY=$(HAVE_VALKEY) $(PY) -m pytest -q

test-unit: $(STAMP)
	$(PY) -m pytest -q -m 'unit and not soak and not bench'

test-e2e: $(STAMP) valkey-server
	MESH_REQUIRE_VALKEY=$(HAVE_VALKEY) $(PY) -m pytest -q -m 'e2e and not soak and not bench'

soak: $(STAMP)
	$(PY) -m pytest -q -m soak

# whole small runs of the benchmark commands (HTTP path arms, tokenize-load, indexer backends, broker)
# and the three-arm cache-routing quality run: about 100 s
test-bench: $(STAMP) valkey-server
	$(PY) -m pytest -q -m bench

bench: $(STAMP) valkey-server
	$(VENV)/bin/mesh bench broker --json bench/broker.json
	$(VENV)/bin/mesh bench routing --json bench/routing.json
	$(VENV)/bin/mesh bench indexer --json bench/indexer.json
	$(VENV)/bin/mesh bench exchange --json bench/exchange.json

# the HTTP path side by side (direct engine, broker + ZMQ workers, broker + adapters, sglang-router);
# wrk is installed when missing and we may (root with apt-get), else the built-in load generator runs
bench-http: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	@if ! command -v wrk >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y wrk || { apt-get update && apt-get install -y wrk; } || echo "wrk not installed: the built-in load generator runs"; fi
	$(VENV)/bin/mesh bench http --json bench/http.json

# the result pages in docs/results/, one per JSON file (a new run replaces its page); the quality
# matrix's summary is dated by the commit that changed it, not by the checkout
report: $(STAMP)
	$(if $(wildcard bench/*.json),$(PY) -m mesh.lab.report $(wildcard bench/*.json))
	$(PY) -m mesh.lab.report docs/quality-matrix-summary.json \
		--date "$$(git log -1 --format=%cs -- docs/quality-matrix-summary.json 2>/dev/null | grep . || date -u +%F)"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
