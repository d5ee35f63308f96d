"""What RAG pipelines need around the engine: chunk ordering for the integrations, their
shared settings, and the tokenizer the prompt tools count with.

Layers: this package imports the engine's public surface and the client, never the
reverse; the integrations (llama_index.llms.pagedrag, langchain_pagedrag) import it.
"""
