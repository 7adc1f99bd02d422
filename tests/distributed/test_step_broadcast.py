"""The step broadcast: tensors packed into one buffer come back bit for bit (every dtype,
shape and layout), and two gloo ranks pass steps, long control messages and the stop."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch
from kvfleet_runtime.distributed import communication as comm
from kvfleet_runtime.layers.attention import AttentionMetadata


def _odd_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randint(-2**62, 2**62, (5, 6), dtype=torch.int64, generator=g)
    return [
        torch.randint(-2**31, 2**31 - 1, (3,), dtype=torch.int32, generator=g),   # 12 bytes
        torch.randn(2, 3, generator=g).to(torch.bfloat16),                          # 12 bytes
        torch.rand(7, generator=g) > 0.5,                                           # bool
        torch.empty(0, dtype=torch.int64),
        wide.t(),                                                                   # non-contiguous
        wide[:, ::2],                                                               # strided
        torch.empty(0, 4, dtype=torch.int32),
        torch.tensor(3.5, dtype=torch.float64),                                     # 0-dim
        torch.randn(1, 5, generator=g),
        torch.randint(0, 255, (33,), dtype=torch.uint8, generator=g),
        torch.randn(4, generator=g).to(torch.float16).expand(3, 4),                 # stride 0
    ]


def test_packed_tensors_come_back_with_their_dtypes_shapes_and_bytes():
    tensors = _odd_tensors()
    specs, nbytes = comm._pack_layout(tensors)
    assert all(s.offset % comm._ALIGN == 0 for s in specs)
    assert nbytes % comm._ALIGN == 0
    assert nbytes == sum(-(-t.numel() * t.element_size() // 16) * 16 for t in tensors)
    buf = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
    comm._pack(tensors, specs, buf)
    out = comm._unpack(buf, specs)
    for t, o in zip(tensors, out, strict=True):
        assert o.dtype == t.dtype and o.shape == t.shape
        assert torch.equal(o, t)
    # the padding is zeroed, not left over from an earlier step
    ends = [s.offset + t.numel() * t.element_size() for s, t in zip(specs, tensors, strict=True)]
    starts = [s.offset for s in specs[1:]] + [nbytes]
    for end, start in zip(ends, starts, strict=True):
        assert not buf[end:start].any()


def test_a_packed_view_read_with_the_wrong_offset_or_dtype_differs():
    tensors = _odd_tensors()
    specs, nbytes = comm._pack_layout(tensors)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    comm._pack(tensors, specs, buf)
    i = 8       # the float32 [1, 5]
    shifted = comm._TensorSpec(specs[i].shape, specs[i].dtype, specs[i].offset + comm._ALIGN)
    assert not torch.equal(comm._unpack(buf, [shifted])[0], tensors[i])
    as_int = comm._TensorSpec(specs[i].shape, torch.int32, specs[i].offset)
    assert comm._unpack(buf, [as_int])[0].dtype != tensors[i].dtype


def _step(batch: int, seq_len: int = 1000, block: int = 16) -> comm.StepInputs:
    width = -(-seq_len // block)
    seq_lens = [seq_len + i for i in range(batch)]
    starts = list(range(batch + 1))
    meta = AttentionMetadata(
        slot_mapping=torch.arange(batch, dtype=torch.long) * 7,
        block_tables=torch.arange(batch * width, dtype=torch.int32).view(width, batch).t(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=1, max_seq_len=max(seq_lens, default=0), seq_lens_cpu=seq_lens,
        query_start_loc_cpu=starts)
    return comm.StepInputs(torch.arange(batch, dtype=torch.long) + 5,
                           torch.tensor(seq_lens, dtype=torch.long) - 1, meta, list(range(batch)))


# batch 4000: its pickle is longer than one control message
_BATCHES = [1, 256, 0, 4000, 3]


def _same(a: comm.StepInputs, b: comm.StepInputs) -> bool:
    same = [torch.equal(a.input_ids, b.input_ids), torch.equal(a.positions, b.positions),
            a.logits_rows == b.logits_rows]
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        x, y = getattr(a.meta, name), getattr(b.meta, name)
        same.append(x.dtype == y.dtype and torch.equal(x, y))
    for name in ("max_query_len", "max_seq_len", "seq_lens_cpu", "query_start_loc_cpu"):
        same.append(getattr(a.meta, name) == getattr(b.meta, name))
    return all(same)


def _rank(rank: int, port: int, results) -> None:
    from kvfleet_runtime.distributed import parallel_state
    device = torch.device("cpu")
    parallel_state.init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", device, 60)
    try:
        got = []
        for batch in _BATCHES:
            step = comm.broadcast_step(_step(batch) if rank == 0 else None, device)
            got.append(step is not None and _same(step, _step(batch)))
        stopped = comm.broadcast_step(None, device) is None
        results.put((rank, got, stopped))
    finally:
        parallel_state.destroy_tensor_parallel()


def test_two_gloo_ranks_pass_steps_of_every_size_then_the_stop():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = dict((r, (got, stopped)) for r, got, stopped in
                   (results.get(timeout=120) for _ in procs))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert out[1] == ([True] * len(_BATCHES), True)
    assert out[0] == ([True] * len(_BATCHES), True)


@pytest.mark.parametrize("batch", [0, 1, 256])
def test_a_step_broadcast_at_size_one_is_the_step_itself(batch):
    step = _step(batch)
    assert comm.broadcast_step(step, torch.device("cpu")) is step
