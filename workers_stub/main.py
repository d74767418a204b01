"""Simulated worker process entry point: N SimWorkers in one asyncio loop, graceful SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal

from mesh.config import WorkerSettings
from mesh.engine_model import EngineConfig
from mesh.logs import announce, configure, get_logger
from workers_stub.worker import SimWorker

__all__ = ["serve_workers"]


async def serve_workers(settings: WorkerSettings, engine_cfg: EngineConfig | None = None, **kwargs) -> None:
    """Run ``settings.count`` simulated workers until SIGTERM/SIGINT; then drain and exit."""
    configure(settings.log_level)
    log = get_logger(service="worker")
    base = settings.worker_id or f"sim-{os.getpid()}"
    workers = [SimWorker(settings, base if settings.count == 1 else f"{base}-{i}", engine_cfg, **kwargs)
               for i in range(settings.count)]
    tasks = [asyncio.create_task(w.run()) for w in workers]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    announce("workers_started", count=len(workers), brokers=list(settings.brokers), instant=settings.instant)
    waiter = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    for t in done:
        if t is not waiter and t.exception() is not None:
            log.error("worker_crashed", error=repr(t.exception()))
    log.info("workers_draining")
    await asyncio.gather(*(w.drain_and_stop() for w in workers))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    log.info("workers_stopped", served=sum(w.served for w in workers))
    # term() flushes what the closed sockets still hold (their goodbyes), bounded by their linger
    workers[0].ctx.term()
