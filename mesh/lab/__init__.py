"""The lab: what measures, exercises and demonstrates mesh, apart from the product it measures.

* :mod:`mesh.lab.sim` -- ``mesh sim``: discrete-event replay through the real routing code and the
  broker's own core.
* :mod:`mesh.lab.bench` -- ``mesh bench``: broker, routing, exchange, HTTP path, tokenizer, indexer.
* :mod:`mesh.lab.fuzz` -- ``mesh fuzz``: seeded MESH/1 and HTTP frame generators and their runner.
* :mod:`mesh.lab.up` -- ``mesh up``: the all-in-one local demo, driven by :mod:`mesh.lab.loadgen`
  and :mod:`mesh.lab.loadgen_http`; :mod:`mesh.lab.procs` starts real processes for it, the
  benchmarks and the end-to-end tests.

Needs the ``lab`` extra (``pip install 'mesh-router[lab]'``: matplotlib, openai). Nothing in the
product imports this package; ``mesh.cli`` loads the lab commands lazily.
"""

#: Third-party modules the lab needs beyond the product's dependencies (the ``lab`` extra).
REQUIRES = ("matplotlib", "openai")
EXTRA_HINT = "pip install 'mesh-router[lab]'"
#: Commands that need less than the whole extra: ``mesh up`` only drives HTTP with openai (the
#: ``demo`` extra, what ``make demo`` installs: no plotting stack to download).
COMMAND_REQUIRES = {"up": ("openai",), "report": ()}  # mesh report reads JSON and writes markdown
