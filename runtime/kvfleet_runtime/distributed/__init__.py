"""Tensor parallelism across the GPUs of one host: parallel state, collectives, vocab-parallel
embedding and the worker processes (one per rank beyond rank 0, which is the engine itself)."""
