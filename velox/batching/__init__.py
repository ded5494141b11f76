"""Embeddings batching: /v1/embeddings calls of one group leave together (`batch.Batcher`)."""
