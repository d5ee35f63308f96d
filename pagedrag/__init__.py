"""pagedrag: a paged-attention LLM engine with hash-based prefix caching, made for RAG.

    from pagedrag import LLM, SamplingParams
    llm = LLM()   # the embedded SmolLM2-135M-Instruct, offline
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

import logging
import os
import sys

if "torch" not in sys.modules:
    # OpenMP threads that spin without end while they wait burn a core even when the engine
    # is idle, and threads that sleep at once pay a wake-up at every one of a step's few
    # hundred operators (1.5x slower decode, RESULTS.md "CPU threads"). A short spin keeps
    # them awake within a step and asleep between steps; worker/thread_tuner.py drops to
    # fewer threads when other work holds a core. libgomp reads this when torch starts it.
    # A wait policy the user chose stands (libgomp lets GOMP_SPINCOUNT override it). The
    # variable is set only while torch loads, so the application's child processes do not
    # inherit it.
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = "10000"
        try:
            import torch  # noqa: F401  (libgomp reads its environment as torch loads it)
        finally:
            del os.environ["GOMP_SPINCOUNT"]

from pagedrag.config import EngineArgs  # noqa: E402  (after the OpenMP setting)
from pagedrag.worker import fork_trial  # noqa: E402,F401  (a fork of this process knows its forking thread)
from pagedrag.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pagedrag.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams  # noqa: E402
from pagedrag.structured import GuidedDecodingParams, StructuredOutputsParams  # noqa: E402

__version__ = "0.2.0"
__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineArgs", "SamplingParams", "BeamSearchParams",
           "RequestOutputKind", "StructuredOutputsParams", "GuidedDecodingParams",
           "RequestOutput", "CompletionOutput", "configure_logging", "__version__"]


def configure_logging(level: str | None = None) -> None:
    """Print pagedrag's log (the pool size at start, the periodic stats line, warnings) to
    stderr at ``level`` (default: PAGEDRAG_LOG_LEVEL, else INFO). A library adds no handler
    on import: the command line calls this, and so does an import with
    PAGEDRAG_CONFIGURE_LOGGING=1; otherwise the application's logging config decides."""
    logger = logging.getLogger("pagedrag")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s pagedrag: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel((level or os.environ.get("PAGEDRAG_LOG_LEVEL", "INFO")).upper())


if os.environ.get("PAGEDRAG_CONFIGURE_LOGGING") == "1":
    configure_logging()


def __getattr__(name):
    """LLM, LLMEngine and AsyncLLMEngine load torch models: import them only when asked for."""
    if name == "LLM":
        from pagedrag.entrypoints.llm import LLM
        return LLM
    if name == "LLMEngine":
        from pagedrag.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "AsyncLLMEngine":
        from pagedrag.entrypoints.async_engine import AsyncLLMEngine
        return AsyncLLMEngine
    raise AttributeError(f"module 'pagedrag' has no attribute {name!r}")
