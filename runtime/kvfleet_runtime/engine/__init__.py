"""The engine core: block pool, KV cache manager, scheduler, model runner, engine loop."""
