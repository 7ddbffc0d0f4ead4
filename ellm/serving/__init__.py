"""`ellm serve`: an OpenAI-compatible HTTP server over one batch-1 engine with KV slots."""
