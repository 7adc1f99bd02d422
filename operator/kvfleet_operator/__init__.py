"""kvfleet operator: reconciles LLMService resources with kopf."""
