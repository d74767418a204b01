"""CURVE key material and the broker's allow-lists (ZAP), in one place.

* ``mesh keygen --dir DIR NAME`` writes ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret``
  (public + secret) in ZeroMQ's certificate format.
* A broker with ``--curve-secret BROKER.key_secret`` encrypts both ROUTERs. Its allow-lists are
  directories of public ``.key`` files: ``--curve-allow-workers DIR`` for the backend and
  ``--curve-allow-clients DIR`` for the frontend. A peer whose key is not listed fails the CURVE
  handshake: it cannot register or submit, and the failure is counted (``auth_failed``).
* Workers and clients pass their own ``--curve-secret`` and the broker's public key
  (``--curve-server-key BROKER.key``).
"""

from __future__ import annotations

from pathlib import Path

import zmq.auth

from mesh.errors import ConfigError
from mesh.sockets import CurveKeys

__all__ = ["keygen", "server_keys", "client_keys"]


def keygen(directory: str | Path, name: str) -> tuple[Path, Path]:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    pub, sec = zmq.auth.create_certificates(d, name)
    return Path(pub), Path(sec)


def _load(path: str | Path, field: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    try:
        pub, sec = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{field}: cannot read certificate {path}: {exc}") from None
    if need_secret and not sec:
        raise ConfigError(f"{field}: {path} holds no secret key (use the .key_secret file)")
    return pub, sec


def server_keys(secret_path: str | Path) -> CurveKeys:
    pub, sec = _load(secret_path, "curve_secret", True)
    return CurveKeys(public_key=pub, secret_key=sec, server=True)  # type: ignore[arg-type]


def client_keys(secret_path: str | Path, server_public_path: str | Path) -> CurveKeys:
    pub, sec = _load(secret_path, "curve_secret", True)
    server_pub, _ = _load(server_public_path, "curve_server_key", False)
    return CurveKeys(public_key=pub, secret_key=sec, server=False, server_key=server_pub)  # type: ignore[arg-type]
