"""The tokenizer pool's fair shares: one client's flood of long prompts cannot take every thread nor the
whole queue; the threads serve clients round robin. In process, with a tokenizer whose encode waits on
a gate the test opens (no timing: the test sees who started, in what order)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mesh.tokenization import TokenizerBusy, TokenizerPool
from tests.conftest import until


class GatedTokenizer:
    """``encode`` blocks until the test releases its text; records the order jobs started in."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def gate(self, text: str) -> threading.Event:
        with self.lock:
            return self.gates.setdefault(text, threading.Event())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self.lock:
            self.started.append(text)
        if not self.gate(text).wait(30):
            raise TimeoutError(text)
        return [len(text)]


def _pool(tok: GatedTokenizer, **kw) -> TokenizerPool:
    pool = TokenizerPool.__new__(TokenizerPool)
    TokenizerPool.__init__(pool, tok, **kw)  # the pool needs only .encode of its tokenizer
    return pool


def test_a_flooding_client_leaves_a_thread_to_the_others():
    tok = GatedTokenizer()

    async def main():
        pool = _pool(tok, workers=2, max_queued=64, max_queued_per_client=8, max_running_per_client=1)
        flood = [asyncio.ensure_future(pool.encode(f"a{i}", client="attacker")) for i in range(9)]
        await until(lambda: tok.started == ["a0"] and pool.admitted == 9, 5, "one attacker job running, 8 waiting")
        # its ninth waiting job is refused at once, before it costs anything
        with pytest.raises(TokenizerBusy, match="per client"):
            await asyncio.wait_for(pool.encode("a9", client="attacker"), 5)
        # the other client's job runs on the free thread while the attacker's wait in their own queue
        tok.gate("b0").set()
        assert await asyncio.wait_for(pool.encode("b0", client="user"), 10) == [2]
        assert tok.started == ["a0", "b0"]
        for i in range(9):
            tok.gate(f"a{i}").set()
        assert [x[0] for x in await asyncio.wait_for(asyncio.gather(*flood), 10)] == [2] * 9
        pool.close()

    asyncio.run(main())


def test_threads_serve_clients_round_robin():
    tok = GatedTokenizer()

    async def main():
        pool = _pool(tok, workers=1, max_queued=64)
        jobs = [asyncio.ensure_future(pool.encode(t, client=t[0])) for t in ("a0", "a1", "a2", "a3")]
        await until(lambda: tok.started == ["a0"], 5, "a0 running")
        jobs += [asyncio.ensure_future(pool.encode(t, client=t[0])) for t in ("b0", "c0", "b1")]
        await asyncio.sleep(0)
        for k in range(7):  # release the jobs one at a time, in the order the pool starts them
            await until(lambda: len(tok.started) > k, 5, f"job {k} started")
            tok.gate(tok.started[k]).set()
        await asyncio.wait_for(asyncio.gather(*jobs), 10)
        # a0 was running; then one job a client, round robin: b0, c0, a1, b1, a2, a3
        assert tok.started == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"], tok.started
        pool.close()

    asyncio.run(main())


def test_a_cancelled_waiting_job_is_dropped_and_close_fails_the_rest():
    tok = GatedTokenizer()

    async def main():
        pool = _pool(tok, workers=1, max_queued=4)
        running = asyncio.ensure_future(pool.encode("a0", client="a"))
        waiting = [asyncio.ensure_future(pool.encode(t, client="b")) for t in ("b0", "b1")]
        await until(lambda: pool.admitted == 3, 5, "three admitted")
        waiting[0].cancel()
        await until(lambda: pool.admitted == 2, 5, "the cancelled job dropped")
        pool.close()
        with pytest.raises(RuntimeError, match="closed"):
            await asyncio.wait_for(waiting[1], 5)
        tok.gate("a0").set()
        assert await asyncio.wait_for(running, 10) == [2]  # a running job finishes
        assert tok.started == ["a0"]

    asyncio.run(main())
