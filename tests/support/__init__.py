"""Shared test helpers: each module starts one real thing (a server, a checkpoint, an emulator)."""
