"""The server answers as its own /openapi.json says: schemathesis's coverage and fuzzing
phases over every operation, checking that no status code is undocumented, every body
matches its documented schema (OpenAI's error body for errors) and no 5xx is a server
error. The server runs in this process on loopback, over a tiny random model whose
max_model_len bounds every generation (a larger max_tokens is a 400), so the run ends;
the seed is fixed and generation deterministic, so each run sends the same requests.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import httpx
import pytest

from model_fixtures import make_tiny_model

pytest.importorskip("schemathesis")

MAX_MODEL_LEN = 64  # tokens: the longest generation any request can ask for
MAX_EXAMPLES = 8  # per operation in the fuzzing phase
CHECKS = "status_code_conformance,response_schema_conformance,not_a_server_error"
API_KEY = "conformance-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pagedrag import EngineArgs
    from pagedrag.entrypoints.async_engine import AsyncLLMEngine
    from pagedrag.server.app import build_app
    from pagedrag.server.background import BackgroundServer
    from pagedrag.server.serving import ServerConfig

    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=str(path), max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64, max_num_seqs=8))
    config = ServerConfig(served_model_names=["tiny"], api_keys=[API_KEY])
    try:
        with BackgroundServer(build_app(engine, config)) as background:
            yield background
    finally:
        engine.shutdown()


def test_the_schema_documents_the_error_codes(server):
    schema = httpx.get(server.base_url + "/openapi.json").json()
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "500", "503"} <= set(completions)
    assert "422" not in completions
    assert completions["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"}
    assert "401" not in schema["paths"]["/tokenize"]["post"]["responses"]  # outside /v1: no key asked
    assert set(schema["components"]["schemas"]["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in schema["components"]["schemas"]


def test_schemathesis_finds_no_nonconformance(server, tmp_path):
    """With the key (generation runs) and without it (every /v1 call is a 401)."""
    runs = [["--phases", "coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES),
             "-H", f"Authorization: Bearer {API_KEY}"],
            ["--phases", "fuzzing", "--max-examples", "2", "--include-path-regex", "^/v1/"]]
    for options in runs:
        result = subprocess.run(_command(server.base_url, tmp_path, options), capture_output=True, text=True,
                                cwd=tmp_path, timeout=300)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def _command(base_url: str, tmp_path, options: list[str]) -> list[str]:
    runner = shutil.which("schemathesis") or shutil.which("st")
    prefix = [runner] if runner else [sys.executable, "-m", "schemathesis.cli"]
    return [*prefix, "run", base_url + "/openapi.json", "--checks", CHECKS, "--seed", "0",
            "--generation-deterministic", "--no-shrink", "--workers", "1", "--request-timeout", "60",
            "--continue-on-failure", "--no-color", "--report-dir", str(tmp_path), *options]
