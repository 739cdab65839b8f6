"""Generation: KV-cached AR and k-token decoding (``kforcing-generate``), the paged cache and serving."""
