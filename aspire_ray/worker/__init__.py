"""The shard worker: model shard + paged KV shard; runs one step plan at a time."""
