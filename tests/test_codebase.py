"""Guards on the test suite's own shape (issue 16: tests as a codebase)."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_module_is_imported_as_a_helper_library():
    # shared helpers live in tests/*_support.py, tests/abuse_peers.py, tests/fakes.py or conftest,
    # never in a test_* module (importing one re-runs nothing but couples two test files)
    bad = []
    for f in TESTS.glob("*.py"):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if re.match(r"\s*(from tests\.test_\w+ import|import tests\.test_)", line):
                bad.append(f"{f.name}:{n}: {line.strip()}")
    assert not bad, bad


def test_every_test_module_holds_tests():
    # a test_* file without a test function is a helper module under the wrong name
    empty = [f.name for f in TESTS.glob("test_*.py") if not re.search(r"^(async )?def test_", f.read_text(), re.M)]
    assert not empty, empty
