"""What users call: the offline API (LLM, beam search), AsyncLLMEngine for concurrent
callers, and the command line (serve, demo, bench, explain)."""
