"""Long fuzzing of a real broker (``make soak``): MESH_FUZZ_SECONDS (default 180) paced + unpaced,
then the same survival checks as the default run (alive, STATUS, a real request, RSS growth)."""

from __future__ import annotations

import os

import pytest

from tests.test_fuzz import _e2e, check_broker_survived

SECONDS = float(os.environ.get("MESH_FUZZ_SECONDS", "180"))


@pytest.mark.soak
@pytest.mark.timeout(int(SECONDS) + 300)
def test_fuzz_broker_soak(procs):
    check_broker_survived(_e2e(procs, seconds=SECONDS, seed=int(os.environ.get("MESH_FUZZ_SEED", "424242")), peers=6))
