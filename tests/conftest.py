"""Shared fixtures: tests own their processes (random ports, logs in tmp_path, loud teardown)."""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from mesh.lab.procs import Proc, ProcGroup, free_port, wait_for_log_event  # noqa: F401 - free_port: tests import it from here


_E2E_SOURCE_MARKS = ("subprocess", "ProcGroup(", "Popen(", "create_subprocess")
_module_is_e2e: dict[str, bool] = {}


def pytest_configure(config):
    """One converted base tokenizer per kind for the whole session (and the processes tests
    start): mesh.lab.tokenizer_builtin.build_model_dir keeps them in $MESH_TOKENIZER_CACHE."""
    import tempfile

    from mesh.lab.tokenizer_builtin import TOKENIZER_CACHE_ENV

    if not os.environ.get(TOKENIZER_CACHE_ENV):
        config._mesh_tok_cache = tempfile.TemporaryDirectory(prefix="mesh-tok-")
        os.environ[TOKENIZER_CACHE_ENV] = config._mesh_tok_cache.name


_PREBUILD = """
import sys, tempfile
from mesh.lab.tokenizer_builtin import build_model_dir
with tempfile.TemporaryDirectory() as d:
    for kind in sys.argv[1:]:
        build_model_dir(f"{d}/{kind}", tokenizer=kind)
"""


def _start_tokenizer_prebuild(config) -> None:
    """Convert the base tokenizers into the session cache in a background process (niced) while the
    tests before the first one that needs them run: the conversion is seconds of CPU that would
    otherwise be paid in series inside that test's fixture. :func:`tokenizer_cache` waits for it."""
    from mesh.lab.tokenizer_builtin import TOKENIZER_CACHE_ENV

    cache = Path(os.environ[TOKENIZER_CACHE_ENV])
    kinds = [k for k in ("mistral_v3", "tekken") if not (cache / f"{k}_base_tokenizer.json").is_file()]
    if not kinds:
        return
    log = cache / "prebuild.log"
    with log.open("ab") as f:
        config._mesh_tok_prebuild = (subprocess.Popen(
            [sys.executable, "-c", _PREBUILD, *kinds], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}, preexec_fn=lambda: os.nice(10)), log)


@pytest.fixture(scope="session")
def tokenizer_cache(pytestconfig) -> Path:
    """The session's converted base tokenizers, once the background conversion has finished (so a
    fixture's build_model_dir does not convert them a second time alongside it)."""
    from mesh.lab.tokenizer_builtin import TOKENIZER_CACHE_ENV

    pre = getattr(pytestconfig, "_mesh_tok_prebuild", None)
    if pre is not None:
        p, log = pre
        rc = p.wait(600)
        assert rc == 0, f"tokenizer conversion failed ({rc}):\n{log.read_text()[-3000:]}"
    return Path(os.environ[TOKENIZER_CACHE_ENV])


def pytest_unconfigure(config):
    pre = getattr(config, "_mesh_tok_prebuild", None)
    if pre is not None and pre[0].poll() is None:
        pre[0].kill()
        pre[0].wait(10)
    cache = getattr(config, "_mesh_tok_cache", None)
    if cache is not None:
        from mesh.lab.tokenizer_builtin import TOKENIZER_CACHE_ENV

        os.environ.pop(TOKENIZER_CACHE_ENV, None)
        cache.cleanup()


def pytest_collection_modifyitems(config, items):
    """Mark every test ``e2e`` (it starts real processes: the ``procs`` fixture, or a module that
    spawns them itself) or ``unit`` (in-process only), so ``pytest -m unit`` is the fast loop and
    ``pytest -m e2e`` the real-process suite (``make test-unit`` / ``make test-e2e``)."""
    for item in items:
        path = str(item.fspath)
        spawns = _module_is_e2e.get(path)
        if spawns is None:
            try:
                src = Path(path).read_text()
            except OSError:
                src = ""
            spawns = _module_is_e2e[path] = any(m in src for m in _E2E_SOURCE_MARKS)
        e2e = "procs" in getattr(item, "fixturenames", ()) or spawns or item.get_closest_marker("e2e") is not None
        item.add_marker(pytest.mark.e2e if e2e else pytest.mark.unit)


def pytest_collection_finish(session):
    """The selected tests (after -m/-k) that build model dirs ask for ``tokenizer_cache``: start
    converting their base tokenizers now, in the background."""
    if any("tokenizer_cache" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_tokenizer_prebuild(session.config)


class Procs(ProcGroup):
    """A :class:`ProcGroup` that can start several worker processes at once: ``workers()`` calls
    inside ``with group.together():`` spawn immediately and the block's end waits for each one's
    ``workers_started`` line -- the same readiness wait as one by one, only the start-ups overlap
    (each is seconds of imports on a busy 2-core machine)."""

    _pending: list | None = None

    @contextmanager
    def together(self):
        self._pending = []
        try:
            yield self
        finally:
            pending, self._pending = self._pending, None
        for p, event, timeout_s in pending:
            wait_for_log_event(p.log_path, event, timeout_s, p.popen, start=p.log_start)

    def workers(self, name: str, backends: list[str], *extra: str, count: int = 1, timeout_s: float = 30.0) -> Proc:
        if self._pending is None:
            return super().workers(name, backends, *extra, count=count, timeout_s=timeout_s)
        p = super().workers(name, backends, *extra, count=count, wait=False)
        self._pending.append((p, "workers_started", timeout_s))
        return p


@pytest.fixture
def procs(tmp_path: Path):
    """A ProcGroup whose processes are stopped at teardown (all signalled at once); a process that
    ignores SIGTERM for 10 s is SIGKILLed and the test fails (shutdown must be bounded)."""
    group = Procs(tmp_path / "logs")
    yield group
    stubborn = group.stop_all(grace_s=10.0)
    assert not stubborn, f"processes needed SIGKILL at teardown: {stubborn}"


def run(coro, timeout_s: float = 60.0):
    """Run one async test body with a hard timeout (every await in tests is bounded)."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def until(pred, timeout_s: float = 10.0, what: str = "condition", step_s: float = 0.01):
    """Poll ``pred`` (a plain or async callable) until it returns something truthy and return
    that; raise TimeoutError (failing the test) if it has not within ``timeout_s``. A readiness
    wait, not a sleep."""
    t_end = time.monotonic() + timeout_s
    while True:
        r = pred()
        if inspect.isawaitable(r):
            r = await r
        if r:
            return r
        if time.monotonic() > t_end:
            raise TimeoutError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(step_s)  # the poll interval of this readiness wait


def wait_until(pred, timeout_s: float = 10.0, what: str = "condition", step_s: float = 0.01):
    """:func:`until` for code outside an event loop (a plain callable): the first truthy value of
    ``pred()``, or TimeoutError (failing the test) after ``timeout_s``."""
    t_end = time.monotonic() + timeout_s
    while True:
        r = pred()
        if r:
            return r
        if time.monotonic() > t_end:
            raise TimeoutError(f"{what} not reached within {timeout_s}s")
        time.sleep(step_s)  # the poll interval of this readiness wait
