# mesh: two commands on a fresh machine with only python3:  make demo  /  make test
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test soak bench venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mesh up

test: $(STAMP)
	$(PY) -m pytest -q

soak: $(STAMP)
	$(PY) -m pytest -q -m soak

bench: $(STAMP)
	$(VENV)/bin/mesh bench broker --json bench/broker.json
	$(VENV)/bin/mesh bench routing --json bench/routing.json
	$(VENV)/bin/mesh bench indexer --json bench/indexer.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
