"""Velox: a low-latency OpenAI-compatible LLM API gateway."""

__version__ = "0.1.0"
