"""The worker side of MESH/1 as a pure state machine: one :class:`LinkSession` per broker connection.

No sockets, no event loop, no clock: every method takes ``now_s`` (monotonic seconds) and says
what to send; the shell that owns the socket sends it and reports whether the pipe took it. Two
shells drive it: :class:`mesh.worker.link.BrokerLink` (asyncio, one DEALER per broker, used by
:class:`mesh.worker.api.WorkerAPI`: the simulated workers and the adapters) and
:class:`workers_stub.instant.InstantFleet` (a synchronous poller loop for benchmarks).

The protocol, as the shells see it (the ZeroMQ guide's Paranoid Pirate worker, mdwrkapi):

* **Registration.** A new connection (:meth:`LinkSession.open`) owes the broker a READY; until
  READY went out every other send is refused (a heartbeat ahead of READY only earns a
  DISCONNECT). READY goes out when the ZMTP handshake is reported (:meth:`on_handshake`) or, if
  none is reported within ``ready_timeout_s`` (at most half the liveness window), blindly, retried
  every heartbeat interval (:meth:`timer`). The broker's first HEARTBEAT after READY means
  *registered*; the worker confirms at once (the broker routes to a session only once it has heard
  from it since READY). DISCONNECT from the broker means "forget the session": the requests of
  that connection are gone, READY goes out again on the same connection.
* **Reconnected pipe.** A second handshake on the same connection (the broker restarted, or a
  network blip) is answered with one HEARTBEAT at once: a broker that knows the session takes it
  as a heartbeat, one that does not answers DISCONNECT and gets READY straight back.
* **Liveness.** The broker heartbeats every HB; a connection that heard nothing for HB x
  ``liveness`` is given up (:meth:`expired`): the shell destroys the socket, waits
  :meth:`lost` (jittered exponential back-off from :meth:`mesh.retry.RetryPolicy.forever`, capped,
  reset once a broker registered us again) and opens a fresh one with a new identity.
* **Identity.** ``worker_id/epoch/conn_no``: a new connection never reuses a routing id the broker
  may still hold for the previous one.
* **Epoch.** :func:`make_epoch`: one per worker process lifetime (wall-clock milliseconds x 1000
  plus a random salt), so a restarted worker is told from its predecessor.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from mesh import protocol as P
from mesh.retry import RetryPolicy

__all__ = ["Capabilities", "Send", "LinkSession", "make_epoch", "ready_frames"]


def make_epoch(wall_s: float, salt: int) -> int:
    """A worker's epoch: wall-clock milliseconds x 1000 + ``salt`` (0..999, random)."""
    return int(wall_s * 1000) * 1000 + salt % 1000


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a worker announces in READY besides its id, epoch and heartbeat interval."""

    model: str
    role: str = "mixed"
    labels: dict[str, str] = field(default_factory=dict)
    block_size: int = 16
    max_running_requests: int = 256
    max_total_num_tokens: int = 400_000
    dp_size: int = 1
    loras: list[str] | None = None  # LoRA adapters loaded on the engine (None: not reported)
    tokenizer: str = ""  # the engine's tokenizer identity (READY ``tokenizer``); "" unknown


def ready_frames(worker_id: str, epoch: int, heartbeat_ms: int, c: Capabilities) -> list[bytes]:
    """The READY a worker sends on every new session."""
    return P.encode_ready(P.Ready(
        worker_id=worker_id, model=c.model, role=c.role, labels=dict(c.labels), block_size=c.block_size,
        max_running_requests=c.max_running_requests, max_total_num_tokens=c.max_total_num_tokens,
        dp_size=c.dp_size, epoch=epoch, heartbeat_ms=heartbeat_ms, loras=c.loras, tokenizer=c.tokenizer,
    ))


class Send(enum.Enum):
    """What a session asks its shell to send."""

    READY = "ready"
    HEARTBEAT = "heartbeat"


class LinkSession:
    """Protocol state of one (worker, broker) connection, reopened in place on reconnect."""

    def __init__(self, *, heartbeat_ms: int, liveness: int, reconnect: RetryPolicy, ready_timeout_s: float = 1.0) -> None:
        self.hb_s = heartbeat_ms / 1000.0
        self.liveness = liveness
        self.expiry_s = self.hb_s * liveness
        self.reconnect = reconnect
        self.ready_timeout_s = ready_timeout_s
        self.conn_no = 0  # connections opened so far (the current one's number)
        self.registered = False  # True once the broker answered our READY with a HEARTBEAT
        self.ready_due = False  # READY has not gone out on the current connection yet
        self.ready_at_s = 0.0  # when to stop waiting for the handshake and send READY anyway
        self.last_heard_s = 0.0
        self.handshakes = 0  # handshakes seen on the current connection
        self.attempt = 0  # reconnects since a broker last registered us (the back-off exponent)
        # counters
        self.reconnects = 0
        self.ready_sent = 0  # READY frames accepted by a live pipe
        self.ready_fallbacks = 0  # READY sent blindly because no handshake was seen in time

    def identity(self, worker_id: str, epoch: int) -> bytes:
        """The routing id of the current connection."""
        return f"{worker_id}/{epoch}/{self.conn_no}".encode()

    # ------------------------------------------------------------------ connection lifecycle

    def open(self, now_s: float) -> None:
        """A new connection (socket) starts: READY is owed, silence is counted from now."""
        self.conn_no += 1
        self.registered = False
        self.handshakes = 0
        self.ready_due = True
        # the fallback must fire well before the silence expiry would recycle the socket
        self.ready_at_s = now_s + min(self.ready_timeout_s, self.expiry_s / 2)
        self.last_heard_s = now_s

    def closed(self) -> None:
        """The connection's socket is gone."""
        self.registered = False
        self.ready_due = False

    def expired(self, now_s: float) -> bool:
        """True when the broker has been silent for the whole liveness window."""
        return now_s - self.last_heard_s >= self.expiry_s

    def stalled(self, now_s: float) -> None:
        """Our own loop could not run for a while (it woke later than it asked to: a busy host,
        a GC pause, SIGSTOP). What the broker sent meanwhile waits unread in our socket (or in
        libzmq's I/O thread, which stalled too), so the silence is not judged yet: the broker
        gets one heartbeat interval from now to be heard (the broker credits its own stalls
        to worker expiry the same way)."""
        self.last_heard_s = max(self.last_heard_s, now_s - self.expiry_s + self.hb_s)

    def lost(self) -> float:
        """The connection was given up: count it and return the back-off before the next one."""
        self.attempt += 1
        self.reconnects += 1
        return self.reconnect.delay_s(self.attempt)

    # ------------------------------------------------------------------ sends

    def may_send(self) -> bool:
        """Whether ordinary frames may go out (READY went out on this connection)."""
        return not self.ready_due

    def ready_result(self, accepted: bool) -> None:
        """The shell tried to send READY: ``accepted`` is whether a live pipe took it."""
        if accepted:
            self.ready_due = False
            self.ready_sent += 1
        else:
            self.ready_due = True  # retried at the next handshake or fallback tick

    # ------------------------------------------------------------------ inputs

    def on_handshake(self) -> Send | None:
        """The ZMTP handshake of the connection succeeded (again)."""
        self.handshakes += 1
        if self.ready_due:
            return Send.READY
        if self.handshakes > 1:
            return Send.HEARTBEAT  # the same socket reconnected: probe the broker's memory of us
        return None

    def heard(self, now_s: float) -> None:
        """Some frame arrived from the broker."""
        self.last_heard_s = now_s

    def on_message(self, msg: object) -> tuple[Send | None, str | None]:
        """A decoded broker message (after :meth:`heard`). Returns (what to send back, why the
        broker session was lost, or None)."""
        t = type(msg)
        if t is P.Disconnect:
            self.registered = False
            return Send.READY, f"disconnect:{msg.reason}"  # type: ignore[union-attr]
        if t is P.Heartbeat and not self.registered:
            self.registered = True
            self.attempt = 0
            return Send.HEARTBEAT, None  # confirm at once: the broker routes to us only then
        return None, None

    def timer(self, now_s: float) -> Send | None:
        """Call when :meth:`next_timer_s` is due: the READY fallback."""
        if self.ready_due and now_s >= self.ready_at_s:
            self.ready_fallbacks += 1
            self.ready_at_s = now_s + self.hb_s
            return Send.READY
        return None

    def next_timer_s(self) -> float:
        """When :meth:`timer` or :meth:`expired` next has something to say."""
        t = self.last_heard_s + self.expiry_s
        if self.ready_due:
            t = min(t, self.ready_at_s)
        return t
