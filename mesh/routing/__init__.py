"""Routing core: the fleet view, policies and the Router entry point (pure, no I/O)."""
