"""The worker side of MESH/1, written once (see :mod:`mesh.worker.api`).

* :mod:`mesh.worker.session`: :class:`LinkSession`, the pure per-broker protocol state machine
  (registration, READY handshake and fallback, liveness, reconnect back-off) and the epoch formula;
* :mod:`mesh.worker.link`: :class:`BrokerLink`, one asyncio DEALER driven by a session;
* :mod:`mesh.worker.api`: :class:`WorkerAPI`, one worker towards every broker (links, heartbeats
  with LoadStat, KV fan-out, drain).
"""

from mesh.worker.api import WorkerAPI, new_epoch
from mesh.worker.link import BrokerLink
from mesh.worker.session import Capabilities, LinkSession, Send, make_epoch, ready_frames

__all__ = ["BrokerLink", "Capabilities", "LinkSession", "Send", "WorkerAPI", "make_epoch", "new_epoch", "ready_frames"]
