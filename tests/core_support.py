"""Reading what an in-process broker core sent (tests that drive BrokerCore without sockets)."""

from __future__ import annotations

from collections.abc import Iterable

from mesh import protocol as P
from mesh.broker_core.sends import TO_CLIENT, TO_WORKER


def outcomes(sends: Iterable) -> list[str]:
    """Per request the core answered in ``sends`` (``core.take()``): the worker it was sent to, or
    the error code the client got (other frames are skipped)."""
    out = []
    for s in sends:
        if s.to == TO_WORKER and isinstance(P.decode_broker_to_worker(s.frames), P.Request):
            out.append(s.identity.decode())
        elif s.to == TO_CLIENT:
            m = P.decode_client_reply(s.frames)
            if isinstance(m, P.ClientError):
                out.append(m.code)
    return out
