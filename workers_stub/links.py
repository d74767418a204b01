"""Compatibility re-export: the worker's broker link now lives in :mod:`mesh.worker.link`."""

from mesh.worker.link import BrokerLink

__all__ = ["BrokerLink"]
