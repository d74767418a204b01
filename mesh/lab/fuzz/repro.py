"""Minimal reproductions of what the fuzzer found, against a fresh broker with no other worker.

    python -m mesh.lab.fuzz.repro tcp://127.0.0.1:FRONT tcp://127.0.0.1:BACK [name ...]

Each repro prints what it sent and what came back, and ``REPRODUCED`` or ``not reproduced``.
Blocking sockets with bounded polls; no sleeps.
"""

from __future__ import annotations

import sys

import zmq

from mesh import protocol as P

__all__ = ["REPROS", "main"]


def _dealer(ctx: zmq.Context, ep: str, ident: bytes | None = None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if ident is not None:
        s.setsockopt(zmq.ROUTING_ID, ident)
    s.connect(ep)
    return s


def _recv(s: zmq.Socket, timeout_ms: int = 3000) -> list[bytes] | None:
    return s.recv_multipart() if s.poll(timeout_ms) else None


def _worker(ctx, backend: str, wid: str = "repro-w") -> zmq.Socket:
    w = _dealer(ctx, backend, f"{wid}/1/1".encode())
    w.send_multipart(P.encode_ready(P.Ready(wid, "m", "mixed", {}, 16, 64, 100_000, 1, 1, 60_000)))
    while True:
        fr = _recv(w)
        if fr is None:
            raise RuntimeError("no HEARTBEAT after READY")
        if isinstance(P.decode_broker_to_worker(fr), P.Heartbeat):
            return w


def _serve_one(w: zmq.Socket, final_usage: dict, payload: bytes | None = None) -> P.Request:
    while True:
        fr = _recv(w)
        if fr is None:
            raise RuntimeError("no REQUEST reached the repro worker")
        m = P.decode_broker_to_worker(fr)
        if isinstance(m, P.Request):
            frames = P.encode_worker_final(m.rid, m.attempt, "stop", final_usage, {"token_ids": [1]})
            if payload is not None:
                frames[3] = payload
            w.send_multipart(frames)
            return m


def _status(ctx, frontend: str) -> P.StatusReply | None:
    c = _dealer(ctx, frontend)
    try:
        c.send_multipart(P.encode_status_query())
        fr = _recv(c)
        return None if fr is None else P.decode_client_reply(fr)  # type: ignore[return-value]
    finally:
        c.close(0)


def status_overflow(ctx, frontend: str, backend: str) -> bool:
    """Two worker FINALs with usage.prompt_tokens = 2**64-1: the broker's prompt_tokens counter
    passes uint64 and every later STATUS reply fails to pack (OverflowError, handler_failed):
    STATUS never answers again."""
    w = _worker(ctx, backend)
    c = _dealer(ctx, frontend)
    for i in range(2):
        c.send_multipart(P.encode_submit(f"r{i}", input_ids=[1, 2, 3], params={"max_new_tokens": 1}, stream=False))
        _serve_one(w, {"prompt_tokens": 2**64 - 1, "completion_tokens": 1, "cached_tokens": 0})
        print(f"  client got: {P.decode_client_reply(_recv(c) or [b''])}")
    st = _status(ctx, frontend)
    print(f"  STATUS after: {type(st).__name__ if st is not None else 'no reply within 3 s'}")
    w.send_multipart(P.encode_disconnect("bye"))
    w.close(0)
    c.close(0)
    return st is None


def garbage_final_payload(ctx, frontend: str, backend: str) -> bool:
    """A worker FINAL whose opaque frame 3 is not a msgpack map is forwarded verbatim: the client
    cannot decode its only terminal frame (decode_client_reply -> bad_msgpack), so a mesh.client
    request waits until its deadline although the broker counted it ok."""
    w = _worker(ctx, backend)
    c = _dealer(ctx, frontend)
    c.send_multipart(P.encode_submit("g1", input_ids=[1, 2, 3], params={"max_new_tokens": 1}, stream=False))
    _serve_one(w, {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}, payload=b"\xc1")
    fr = _recv(c)
    m = P.decode_client_reply(fr) if fr else None
    print(f"  client got: {m!r}")
    w.send_multipart(P.encode_disconnect("bye"))
    w.close(0)
    c.close(0)
    return m is None or not isinstance(m, P.ClientFinal)


def zero_identity_client(ctx, frontend: str, backend: str) -> bool:
    """A ZeroMQ client whose ROUTING_ID starts with 0x00 and is longer than 5 bytes (libzmq lets any
    peer set one) is taken for an in-process HTTP client: every reply is dropped
    (dropped.client_unreachable), even STATUS."""
    c = _dealer(ctx, frontend, b"\x00fuzz\x02")
    c.send_multipart(P.encode_status_query())
    fr = _recv(c)
    print(f"  reply to STATUS from identity 00 66757a7a 02: {'none within 3 s' if fr is None else P.decode_client_reply(fr)}")
    c.close(0)
    return fr is None


REPROS = {"status_overflow": status_overflow, "garbage_final_payload": garbage_final_payload,
          "zero_identity_client": zero_identity_client}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__)
        return 2
    frontend, backend, names = argv[0], argv[1], argv[2:] or list(REPROS)
    ctx = zmq.Context()
    found = 0
    try:
        for name in names:
            print(f"{name}: {REPROS[name].__doc__.split(chr(10))[0]}")
            hit = REPROS[name](ctx, frontend, backend)
            found += hit
            print(f"  {'REPRODUCED' if hit else 'not reproduced'}")
    finally:
        ctx.destroy(0)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
