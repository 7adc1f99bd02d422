"""kvfleet runtime: a paged-KV-cache LLM inference engine."""
