"""hf_paged: paged KV cache for transformers generate."""
