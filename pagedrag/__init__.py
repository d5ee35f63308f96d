"""pagedrag: a paged-attention LLM engine with hash-based prefix caching, made for RAG.

    from pagedrag import LLM, SamplingParams
    llm = LLM()   # the embedded SmolLM2-135M-Instruct, offline
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

import logging
import os

from .config import EngineArgs
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import BeamSearchParams, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "BeamSearchParams",
           "RequestOutput", "CompletionOutput", "__version__"]

def _configure_logging() -> None:
    """Log INFO (the pool size at start, ...) to stderr; PAGEDRAG_LOG_LEVEL changes the level."""
    logger = logging.getLogger("pagedrag")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s pagedrag: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("PAGEDRAG_LOG_LEVEL", "INFO").upper())
        logger.propagate = False


_configure_logging()


def __getattr__(name):
    """LLM and LLMEngine load torch models: import them only when asked for."""
    if name == "LLM":
        from .llm import LLM
        return LLM
    if name == "LLMEngine":
        from .engine import LLMEngine
        return LLMEngine
    raise AttributeError(f"module 'pagedrag' has no attribute {name!r}")
