"""Decoder models with our own forward over the paged KV cache, and their loaders."""
