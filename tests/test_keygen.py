"""``mesh keygen`` run as the real command: no silent overwrite, secret keys 0600 from creation,
no path traversal in names, a missing output directory created 0700."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth


def keygen(*args: str, cwd: Path, umask: int = 0o022) -> subprocess.CompletedProcess:
    """Run ``mesh keygen ARGS`` in its own process (with a given umask: the usual 022 leaves
    files created with open()'s default mode world-readable)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-c", f"import os, sys; os.umask({umask:#o}); from mesh.cli import main; sys.exit(main())",
                           "keygen", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def test_keygen_writes_a_loadable_pair_with_private_secret(tmp_path):
    r = keygen("broker", "--dir", "keys", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    d = tmp_path / "keys"
    assert _mode(d) == 0o700  # created by keygen: only the owner may list it
    pub, sec = d / "broker.key", d / "broker.key_secret"
    assert _mode(sec) == 0o600, oct(_mode(sec))
    assert _mode(pub) == 0o644
    p1, s1 = zmq.auth.load_certificate(sec)
    p2, s2 = zmq.auth.load_certificate(pub)
    assert p1 == p2 and len(p1) == 40 and s1 and len(s1) == 40 and s2 is None
    assert sorted(x.name for x in d.iterdir()) == ["broker.key", "broker.key_secret"]  # no temporary left over


def test_keygen_refuses_to_overwrite_without_force(tmp_path):
    assert keygen("w", "--dir", str(tmp_path), cwd=tmp_path).returncode == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    r = keygen("w", "--dir", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "w.key" in r.stderr and "--force" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing touched

    # only the public half present: still a refusal (a pair is never mixed)
    (tmp_path / "w.key_secret").unlink()
    r = keygen("w", "--dir", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 2 and "w.key" in r.stderr
    assert not (tmp_path / "w.key_secret").exists()

    r = keygen("w", "--dir", str(tmp_path), "--force", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    new_pub, new_sec = zmq.auth.load_certificate(tmp_path / "w.key_secret")
    assert new_pub == zmq.auth.load_certificate(tmp_path / "w.key")[0]
    assert (tmp_path / "w.key").read_bytes() != before["w.key"]
    assert _mode(tmp_path / "w.key_secret") == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.key", "w.key_secret"]


def test_force_replaces_a_widened_or_symlinked_secret_without_following_it(tmp_path):
    assert keygen("w", "--dir", str(tmp_path), cwd=tmp_path).returncode == 0
    os.chmod(tmp_path / "w.key_secret", 0o644)
    victim = tmp_path / "victim.txt"
    victim.write_text("do not touch")
    (tmp_path / "w.key").unlink()
    (tmp_path / "w.key").symlink_to(victim)
    r = keygen("w", "--dir", str(tmp_path), "--force", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert _mode(tmp_path / "w.key_secret") == 0o600  # a new file, not the old widened one
    assert victim.read_text() == "do not touch"
    assert not (tmp_path / "w.key").is_symlink()


def test_secret_is_private_even_with_a_permissive_umask(tmp_path):
    r = keygen("c", "--dir", str(tmp_path), cwd=tmp_path, umask=0)
    assert r.returncode == 0, r.stderr
    assert _mode(tmp_path / "c.key_secret") == 0o600


@pytest.mark.parametrize("name", ["../../x", "../x", "a/b", "<tmp>/abs", ".hidden", "..", ".", "", "x" * 65, "a b", "é"])
def test_keygen_rejects_names_that_are_not_plain_stems(tmp_path, name):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    name = name.replace("<tmp>", str(tmp_path))  # an absolute path, kept inside the test's directory
    r = keygen(name, "--dir", "keys", cwd=work)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "name" in r.stderr
    found = [p for p in tmp_path.rglob("*") if p.is_file() or p.is_symlink()]
    assert found == []  # nothing written anywhere, inside or outside --dir
    assert not (work / "keys").exists()


@pytest.mark.parametrize("name", ["broker", "worker-0", "client_app.v2", "A" * 64])
def test_keygen_accepts_plain_names(tmp_path, name):
    r = keygen(name, "--dir", str(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / f"{name}.key_secret").is_file()
