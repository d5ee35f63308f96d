"""pagedrag: paged KV attention and prefix caching for RAG pipelines."""
