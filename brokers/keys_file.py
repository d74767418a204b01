"""The keys file shell: reads ``--keys-file`` (bounded), folds in ``--api-key`` and ``--admin-key-file``,
and hands the pure :func:`mesh.tenants.parse_keys` the text. Used by ``mesh broker`` and ``mesh gateway``.

* No keys file, no API key, no admin key: None (no authentication, as before).
* ``--api-key`` alone (the old single key): one ``default`` tenant that may also use the admin API,
  exactly as before. With a keys file or ``--admin-key-file`` it is an inference key only.
* ``--admin-key-file``: a key of its own, tenant ``admin``, the admin right.
"""

from __future__ import annotations

from pathlib import Path

from mesh.errors import ConfigError
from mesh.tenants import DEFAULT_TENANT, MAX_KEYS_FILE_BYTES, KeyRing, Tenant, parse_keys

__all__ = ["load_key_ring", "read_secret"]


def read_secret(path: str, field: str) -> str:
    """A one-line key file (stripped); a ConfigError names ``field`` when it is unreadable or empty."""
    try:
        key = Path(path).read_text(errors="strict")[:4096].strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{field}: cannot read {path}: {exc}") from None
    if not key:
        raise ConfigError(f"{field}: {path} is empty")
    return key


def load_key_ring(keys_file: str = "", api_key: str | None = None, admin_key: str | None = None) -> KeyRing | None:
    if not (keys_file or api_key or admin_key):
        return None
    if keys_file:
        try:
            with open(keys_file, "rb") as f:
                data = f.read(MAX_KEYS_FILE_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"keys_file: cannot read {keys_file}: {exc.strerror or exc}") from None
        ring = parse_keys(data, f"keys_file {keys_file}")
    else:
        ring = KeyRing()
    if api_key:
        legacy_admin = not keys_file and not admin_key
        base = ring.tenants.get(DEFAULT_TENANT.name, DEFAULT_TENANT)
        tenant = Tenant(base.name, base.priority, base.weight, base.max_inflight, base.tokens_per_min, legacy_admin)
        ring.tenants[tenant.name] = tenant
        try:
            ring.add_key(api_key, tenant)
        except ConfigError as exc:
            raise ConfigError(f"api_key: {exc}") from None
    if admin_key:
        try:
            ring.add_key(admin_key, ring.tenants.get("admin") or Tenant("admin", admin=True))
        except ConfigError as exc:
            raise ConfigError(f"admin_key_file: {exc}") from None
        if not ring.tenants["admin"].admin:
            raise ConfigError("admin_key_file: the keys file's tenant 'admin' has admin = false")
    return ring
