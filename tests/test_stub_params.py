"""The simulated workers (``mesh worker-stub``) honour what they can and refuse the rest by name
(issue 30): ``max_new_tokens: 0`` prefills and generates nothing; ``stop`` and constrained output
(``response_format`` -> ``json_schema``), which made-up output cannot honour, are refused naming
the parameter (they used to be ignored: 5 of 12 JSON-mode answers were not JSON)."""

from __future__ import annotations

import pytest

from mesh.client import Client
from mesh.errors import RequestError
from mesh.lab.up import wait_for_workers
from tests.conftest import run


def test_simulated_workers_honour_max_tokens_0_and_refuse_stop_and_json_by_name(procs):
    b = procs.broker("b")
    procs.workers("w", [b.backend], "--time-scale", "0.01")

    async def body():
        await wait_for_workers(b.frontend, 1)
        async with Client(b.frontend) as c:
            for stream in (False, True):
                res = await c.generate(input_ids=list(range(1, 40)), max_new_tokens=0, stream=stream, deadline_ms=10_000)
                assert res.token_ids == [] and res.finish_reason == "length", res
                assert res.usage["completion_tokens"] == 0 and res.usage["prompt_tokens"] == 39
            for params, name in (({"stop": ["\n"]}, "stop"), ({"json_schema": '{"type": "object"}'}, "response_format"),
                                 ({"stop_token_ids": [2]}, "stop_token_ids")):
                with pytest.raises(RequestError) as ei:
                    await c.generate(input_ids=[1, 2, 3], max_new_tokens=4, params=params, deadline_ms=10_000)
                assert ei.value.code.value == "bad_request" and f"{name}: not supported" in str(ei.value), str(ei.value)

    run(body(), 60)
