"""The OpenAI-compatible HTTP server (`kvfleet serve`): protocol, routes, metrics, CLI."""
