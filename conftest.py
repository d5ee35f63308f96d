"""The test suite's two lanes and how it shares the cores.

Lanes: everything (the README's `bash scripts/test.sh`, what CI runs), and the fast lane of
unit, property and kernel tests (`bash scripts/test.sh -m "not slow"`). Every test outside
FAST_MODULES is marked ``slow``: those load the embedded model, start a server or a
subprocess, run the notebook or an integration's pipeline. A new test module is slow until
it is listed here, so the fast lane never grows by accident.

Cores: scripts/test.sh runs two pytest-xdist workers (``--dist loadgroup``), each taking whole
modules (one engine or server per module stays one; both integrations' suites are one unit). Each worker is pinned to a core of its own, so pagedrag's thread
default (one thread per physical core it may run on: worker/cpu_threads.py) gives it one
thread, and the servers, ranks and notebook kernels it starts inherit that core. Measured on
2 cores (benchmarks/RESULTS.md, "The test suite on 2 cores"): 10.2 minutes of pytest, where one
process took 24-25. The longest units are handed out first so that none of them starts last
and runs alone.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys

import pytest

FAST_MODULES = frozenset({
    "test_block_pool", "test_canonical", "test_chat_template_sandbox", "test_chunk_reuse_hostile",
    "test_detokenizer", "test_engine_api", "test_engine_equivalence", "test_explain", "test_fused",
    "test_kernels", "test_kv_tier_stores", "test_kv_tiers", "test_prefix_keys", "test_protocol",
    "test_pipelined_drafting", "test_request_isolation", "test_sampler", "test_sampling_extras", "test_schema_keywords",
    "test_spec_decode", "test_thread_tuner", "test_tools",
})
# what runs longest on 2 cores (--durations=0 summed per unit, 2026-12-04), longest first: each is
# handed to a worker before the rest, so that none of them starts last and runs alone, and the
# last units to be handed out are short ones that even out the two workers' totals
LONGEST_GROUPS = ("integrations", "test_notebook", "test_fuzz_server", "test_structured_outputs",
                  "test_chunk_reuse", "test_server_structured", "test_kernels", "test_router", "test_server",
                  "test_chunk_reuse_hostile", "test_kv_tier_stores", "test_tensor_parallel", "test_client",
                  "test_server_shutdown", "test_engine_equivalence", "test_server_load", "test_models")


def xdist_group_of(item: pytest.Item) -> str:
    """The unit a worker runs whole: a module, or both integrations' suites together (they share
    engines and one ``pagedrag serve`` per process: integrations/testing_support.py)."""
    return "integrations" if "integrations" in item.path.parts else item.path.stem


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and hasattr(os, "sched_setaffinity"):
        _pin_to_one_core(int(worker.removeprefix("gw")))


def _pin_to_one_core(worker_index: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[worker_index % len(cpus)]})
        os.environ["OMP_NUM_THREADS"] = "1"  # torch code outside an engine (HF references), subprocesses
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def free_each_modules_engines():
    """After each module, the integrations' shared in-process engines (one per set of engine
    arguments, kept for the process's life: client/inprocess.py) are shut down and collected:
    kept, they added up to 12 GB in one worker, and two workers ran out of 24 GB."""
    yield
    inprocess = sys.modules.get("pagedrag.client.inprocess")
    if inprocess is not None:
        inprocess.shutdown_shared_engines()
    gc.collect()
    _malloc_trim()


def _malloc_trim() -> None:
    """Give the heap's freed pages back to the system (glibc keeps them otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups off the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem not in FAST_MODULES:
            item.add_marker(pytest.mark.slow)
        item.add_marker(pytest.mark.xdist_group(xdist_group_of(item)))
    rank = {name: index for index, name in enumerate(LONGEST_GROUPS)}
    items.sort(key=lambda item: rank.get(xdist_group_of(item), len(rank)))  # stable: file order kept otherwise
