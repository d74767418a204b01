"""The broker's lifecycle as a pure core: the request table and the worker pool as state machines.

``brokers/broker.py`` is a thin shell over :class:`BrokerCore` (sockets, timers, HTTP); the
simulator (``mesh sim --faults``) and the property-based tests run the same core in virtual time.
"""

from mesh.broker_core.core import BrokerCore
from mesh.broker_core.counters import BrokerStats, LatencyHistogram
from mesh.broker_core.pool import SESSION_TRANSITIONS, IllegalTransition, SessionState, WorkerPool, WorkerSession
from mesh.broker_core.requests import REQUEST_TRANSITIONS, Inflight, RequestState
from mesh.broker_core.sends import TO_CLIENT, TO_WORKER, Receipt, Send, deliver
from mesh.broker_core.workers import HB_SLICES

__all__ = ["BrokerCore", "HB_SLICES", "BrokerStats", "LatencyHistogram", "WorkerPool", "WorkerSession", "SessionState",
           "SESSION_TRANSITIONS", "IllegalTransition", "Inflight", "RequestState", "REQUEST_TRANSITIONS", "Send", "Receipt",
           "TO_WORKER", "TO_CLIENT", "deliver"]
