"""The engine: LLMEngine's step loop (llm_engine), what a request brings in (inputs), what
comes out of a step (output_processor, detokenizer), and recovery from a failed step.

LLMEngine loads torch models, so it is imported only when asked for: the light modules
here (inputs, detokenizer, recovery) stay cheap to import for clients and servers.
"""


def __getattr__(name):
    if name == "LLMEngine":
        from pagedrag.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(f"module 'pagedrag.engine' has no attribute {name!r}")
