"""Speculative decoding drafted from the context (no draft model).

``config`` reads ``EngineArgs.speculative_config`` (vLLM's keys); ``ngram`` and ``suffix`` are
the proposers; ``drafter`` decides which running requests draft and how far, and counts what
the verifier accepted. The verification itself is the target model's step over 1 + k tokens
a row (core.scheduler, worker.model_runner) and worker.rejection_sampler.
"""
