"""CURVE key material and the broker's allow-lists (ZAP), in one place.

* ``mesh keygen --dir DIR NAME`` writes ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret``
  (public + secret) in ZeroMQ's certificate format. ``NAME`` is ``[A-Za-z0-9._-]{1,64}`` not
  starting with ``.`` (no paths); ``DIR`` is created with mode 0700 when missing. Existing
  files are never overwritten unless ``--force``. The secret file is created with mode 0600 by
  ``open(O_CREAT|O_EXCL, 0o600)`` (never readable by others, not even for a moment); with
  ``--force`` the new file is written the same way under a temporary name and renamed over the
  old one (atomic: the old pair or the new one, never a half-written or widened file).
* A broker with ``--curve-secret BROKER.key_secret`` encrypts both ROUTERs. Its allow-lists are
  directories of public ``.key`` files: ``--curve-allow-workers DIR`` for the backend and
  ``--curve-allow-clients DIR`` for the frontend. A peer whose key is not listed fails the CURVE
  handshake: it cannot register or submit, and the failure is counted (``auth_failed``). Each
  list guards its own socket only (one ZAP rule per domain, :func:`configure_allow_lists`); a
  socket without a list admits any key, and the broker logs ``curve_allow_any`` for it. The
  peer exchange (ZAP domain ``peers``) admits only the brokers' own key pair.
* Workers and clients pass their own ``--curve-secret`` and the broker's public key
  (``--curve-server-key BROKER.key``).
"""

from __future__ import annotations

import datetime
import os
import re
import secrets
from pathlib import Path

import zmq
import zmq.auth

from mesh.errors import ConfigError
from mesh.sockets import CurveKeys

__all__ = ["keygen", "server_keys", "client_keys", "valid_key_name", "allowed_key_names", "key_may_claim",
           "CurveAllowList", "configure_allow_lists", "exchange_keys"]

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_SECRET_BANNER = ("#   ****  Generated on {0} by mesh keygen  ****\n#   ZeroMQ CURVE **Secret** Certificate\n"
                  "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n\n")
_PUBLIC_BANNER = ("#   ****  Generated on {0} by mesh keygen  ****\n#   ZeroMQ CURVE Public Certificate\n"
                  "#   Exchange securely, or use a secure mechanism to verify the contents of this file after exchange.\n\n")


def valid_key_name(name: str) -> bool:
    """A key name is a plain file name stem: ``[A-Za-z0-9._-]{1,64}``, not starting with ``.``."""
    return bool(_NAME.fullmatch(name)) and not name.startswith(".")


def _cert_text(banner: str, public_key: bytes, secret_key: bytes | None = None) -> bytes:
    text = banner.format(datetime.datetime.now()) + "metadata\ncurve\n"
    text += f'    public-key = "{public_key.decode()}"\n'
    if secret_key is not None:
        text += f'    secret-key = "{secret_key.decode()}"\n'
    return text.encode()


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` (it must not exist) with ``mode`` from the first byte on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if fd >= 0:
            os.close(fd)
        path.unlink(missing_ok=True)
        raise


def _write_replace(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to a fresh temporary file next to ``path`` (created with ``mode``), then
    rename it over ``path`` (atomic; a symlink at ``path`` is replaced, never followed)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    _write_new(tmp, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def keygen(directory: str | Path, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write ``DIR/NAME.key`` (public, 0644) and ``DIR/NAME.key_secret`` (0600); return both paths.

    Raises ConfigError for a bad name, or when a file exists and ``force`` is false (nothing is
    written then)."""
    if not valid_key_name(name):
        raise ConfigError(f"name: {name!r} is not a valid key name (use 1-64 of A-Z a-z 0-9 . _ -, not starting with '.')")
    d = Path(directory)
    if not d.exists():
        try:
            d.mkdir(mode=0o700, parents=True)
        except FileExistsError:
            pass
    elif not d.is_dir():
        raise ConfigError(f"dir: {d} exists and is not a directory")
    pub_path, sec_path = d / f"{name}.key", d / f"{name}.key_secret"
    if not force:
        for p in (sec_path, pub_path):
            if os.path.lexists(p):
                raise ConfigError(f"{p} already exists; refusing to overwrite it (pass --force to replace the key pair)")
    public_key, secret_key = zmq.curve_keypair()
    sec_data = _cert_text(_SECRET_BANNER, public_key, secret_key)
    pub_data = _cert_text(_PUBLIC_BANNER, public_key)
    try:
        if force:
            _write_replace(sec_path, sec_data, 0o600)
            _write_replace(pub_path, pub_data, 0o644)
        else:
            _write_new(sec_path, sec_data, 0o600)
            try:
                _write_new(pub_path, pub_data, 0o644)
            except BaseException:
                sec_path.unlink(missing_ok=True)  # never leave half a pair behind
                raise
    except FileExistsError as exc:  # created by someone else since the check above
        raise ConfigError(f"{exc.filename} already exists; refusing to overwrite it (pass --force to replace the key pair)") from None
    except OSError as exc:
        raise ConfigError(f"dir: cannot write keys in {d}: {exc.strerror or exc}") from None
    return pub_path, sec_path


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


def exchange_keys(curve: CurveKeys | None, exchange_secret: str = "",
                  peer_key_files: tuple[str, ...] = ()) -> tuple[CurveKeys | None, list[bytes] | None]:
    """The peer exchange's own key pair and its peers' public keys (one per ``--peer``, in
    order): ``--exchange-curve-secret`` (default: the broker's ``--curve-secret`` pair) and
    ``--peer-curve-keys`` (default: none, every broker holds the shared pair)."""
    x = server_keys(exchange_secret) if exchange_secret else curve
    keys = [_load(f, "peer_curve_keys", False)[0] for f in peer_key_files] if peer_key_files else None
    return x, keys


def allowed_key_names(allow_dir: str | Path, field: str = "curve_allow_workers") -> dict[bytes, str]:
    """An allow-list directory as ``z85 public key -> key name`` (the ``NAME`` of ``NAME.key``):
    the broker binds each registration to the key its connection authenticated with."""
    from zmq.auth import load_certificate

    out: dict[bytes, str] = {}
    for path in sorted(Path(allow_dir).glob("*.key")):
        try:
            public, _ = load_certificate(str(path))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{field}: {path} is not a public key file ({exc})") from None
        out[public] = path.stem
    return out


class CurveAllowList:
    """A ZAP credentials provider for one domain: any key (``keys`` None) or the listed z85 keys.

    Why not ``Authenticator.configure_curve``: pyzmq keeps *one* allow-any switch for every ZAP
    domain, so the last domain configured with ``CURVE_ALLOW_ANY`` (or without it) decided the
    other domains too: a worker allow-list with no client allow-list admitted any worker key,
    and a client allow-list alone refused every worker. A provider per domain keeps each
    domain's rule its own, and a domain nobody configured is refused."""

    def __init__(self, keys: frozenset[bytes] | None) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return self.keys is None or key in self.keys


def configure_allow_lists(auth, lists: dict[str, frozenset[bytes] | None]) -> None:
    """Give the authenticator ``auth`` one :class:`CurveAllowList` per ZAP domain (``None``:
    any key)."""
    for domain, keys in lists.items():
        auth.configure_curve_callback(domain=domain, credentials_provider=CurveAllowList(keys))


def key_may_claim(key_name: str, worker_id: str) -> bool:
    """A worker key named ``NAME`` may register as ``NAME`` or ``NAME-...`` / ``NAME/...`` (one
    process with ``--count N`` registers ``NAME-0`` .. ``NAME-{N-1}``), and as nothing else."""
    return worker_id == key_name or worker_id.startswith((key_name + "-", key_name + "/"))
