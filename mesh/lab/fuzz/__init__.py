"""A protocol-aware fuzzer for mesh brokers (``mesh fuzz``).

* :mod:`mesh.lab.fuzz.generators`: pure, seeded MESH/1 frame generators and mutations (no I/O);
* :mod:`mesh.lab.fuzz.runner`: the shell that drives ZeroMQ peers on both broker ports (registered
  fuzzing workers that also answer REQUESTs, unregistered junk peers, clients with exactly-once
  accounting), paced and unpaced, then checks the broker (alive, STATUS, a real request, RSS);
* :mod:`mesh.lab.fuzz.http`: mutated JSON bodies against the HTTP ingress;
* :mod:`mesh.lab.fuzz.cli`: the ``mesh fuzz`` subcommand.
"""
