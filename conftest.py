"""The test suite's two lanes: everything (the README's `bash scripts/test.sh`, what CI runs),
and the fast lane of unit, property and kernel tests (`bash scripts/test.sh -m "not slow"`).

Every test outside FAST_MODULES is marked ``slow``: those load the embedded model, start a
server or a subprocess, run the notebook or an integration's pipeline. A new test module is
slow until it is listed here, so the fast lane never grows by accident.
"""

from __future__ import annotations

import pytest

FAST_MODULES = frozenset({
    "test_block_pool", "test_canonical", "test_chat_template_sandbox", "test_chunk_reuse_hostile",
    "test_detokenizer", "test_engine_api", "test_engine_equivalence", "test_explain", "test_fused",
    "test_kernels", "test_kv_tier_stores", "test_kv_tiers", "test_request_isolation", "test_sampler",
    "test_sampling_extras", "test_schema_keywords", "test_spec_decode", "test_tools",
})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem not in FAST_MODULES:
            item.add_marker(pytest.mark.slow)
