"""Adapters that attach real inference servers (SGLang, vLLM) to a mesh as workers.

An adapter process stands next to one server: it reads the server's ZMQ KV event and load
streams, registers with every broker as that worker (``mesh.protocol`` READY/HEARTBEAT/KV_EVENTS),
and serves mesh REQUESTs by calling the server's HTTP API. See :mod:`mesh.adapters.base`.
"""
