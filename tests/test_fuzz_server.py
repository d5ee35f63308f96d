"""The fuzz suite: hostile and generated requests never hurt other requests.

Each of benchmarks/fuzz_server.py's HOSTILE_CASES is sent alone while canaries run and
must get its expected status; then run_fuzz sends generated (hypothesis), schemathesis
and hostile requests together from several threads. Throughout: no undeclared 5xx or
dropped connection, canaries keep their answer and are never stalled long, /health
answers quickly; afterwards the KV pool is all free and the RSS near where it was.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ of this checkout
from benchmarks.fuzz_server import (HOSTILE_CASES, Bounds, Watch, canary_answer, check_hostile,  # noqa: E402
                                    pool_problems, run_fuzz, send, serve_embedded, wait_idle)

NUM_GENERATED = 400
SCHEMATHESIS_EXAMPLES = 15  # per operation and generation mode
NUM_CLIENTS = 6
TIME_LIMIT_S = 150  # requests not sent by then are skipped, and that fails the test
BOUNDS = Bounds(canary_s=20.0, health_s=2.0, rss_growth_mb=300.0)


@pytest.fixture(scope="module")
def served():
    """(engine, server) on the embedded model, as benchmarks/fuzz_server.py runs it."""
    with serve_embedded() as served:
        yield served


@pytest.fixture(scope="module")
def expected(served) -> str:
    """The canary answer every later canary request must get."""
    return canary_answer(served[1].base_url)


@pytest.mark.parametrize("case", HOSTILE_CASES, ids=lambda case: case.name)
def test_hostile_request(served, expected, case):
    """The case gets its expected status (a clean 4xx with an OpenAI error body, or a
    correct 200) while canaries keep their answer and /health answers quickly; then the
    KV pool is all free."""
    engine, server = served
    with Watch(server.base_url, expected) as watch, httpx.Client(base_url=server.base_url) as client:
        problems = check_hostile(case, send(client, case.request()), client)
        watch.settle()
    assert [*problems, *watch.report.problems(BOUNDS), *pool_problems(wait_idle(engine))] == []


def test_fuzz(served, capsys):
    """Generated, schemathesis and hostile requests from several threads at once."""
    pytest.importorskip("schemathesis")
    engine, server = served
    report = run_fuzz(server.base_url, NUM_GENERATED, seed=0, num_clients=NUM_CLIENTS,
                      schemathesis_examples=SCHEMATHESIS_EXAMPLES, engine=engine, time_limit_s=TIME_LIMIT_S)
    with capsys.disabled():
        print("\n" + report.markdown(BOUNDS))
    assert report.problems(BOUNDS) == []
