"""The GPTQ / AWQ packers against words computed by hand, and unpack(pack(v)) == v."""

from __future__ import annotations

import pytest
import torch
from kvfleet_runtime.layers.quantization.awq import pack_awq, unpack_awq
from kvfleet_runtime.layers.quantization.gptq import pack_gptq, unpack_gptq
from kvfleet_runtime.layers.quantization.packing import AWQ_ORDER, pack_int32, unpack_int32


def as_int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def test_gptq_packs_eight_input_rows_into_one_word_low_nibble_first():
    # column n holds rows 0..7 = 1..8: nibble j of the word is row j
    q = torch.arange(1, 9).reshape(8, 1).repeat(1, 8)
    zeros = torch.full((1, 8), 8)                 # symmetric 4-bit: zero point 8
    packed = pack_gptq(q, zeros, torch.ones(1, 8), torch.zeros(8, dtype=torch.int32), bits=4)
    assert packed["qweight"].shape == (1, 8)
    assert packed["qweight"].tolist() == [[as_int32(0x87654321)] * 8]
    # v1 stores zero - 1: the familiar 0x77777777 of symmetric GPTQ checkpoints
    assert packed["qzeros"].tolist() == [[0x77777777]]


def test_gptq_v2_stores_the_zero_point_itself():
    zeros = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 15]])
    packed = pack_gptq(torch.zeros(8, 8, dtype=torch.int64), zeros, torch.ones(1, 8),
                       torch.zeros(8), bits=4, checkpoint_format="gptq_v2")
    assert packed["qzeros"].tolist() == [[as_int32(0xF6543210)]]


def test_gptq_8bit_packs_four_rows_per_word():
    q = torch.tensor([[1], [2], [3], [0xFF]]).repeat(1, 4)
    packed = pack_gptq(q, torch.full((1, 4), 128), torch.ones(1, 4), torch.zeros(4), bits=8)
    assert packed["qweight"].tolist() == [[as_int32(0xFF030201)] * 4]
    assert packed["qzeros"].tolist() == [[0x7F7F7F7F]]


def test_gptq_v1_cannot_store_a_zero_point_of_zero():
    with pytest.raises(ValueError, match="zero point of 0"):
        pack_gptq(torch.zeros(8, 8, dtype=torch.int64), torch.zeros(1, 8, dtype=torch.int64),
                  torch.ones(1, 8), torch.zeros(8), bits=4)


def test_awq_packs_eight_output_columns_in_interleaved_order():
    # row holds columns 0..7 = 0..7; slot j holds column AWQ_ORDER[j] = 0,2,4,6,1,3,5,7
    q = torch.arange(8).reshape(1, 8)
    packed = pack_awq(q, q.clone(), torch.ones(1, 8))
    assert packed["qweight"].tolist() == [[0x75316420]]
    assert packed["qzeros"].tolist() == [[0x75316420]]


def test_awq_unpack_restores_column_order():
    weight = unpack_awq(torch.tensor([[0x75316420]], dtype=torch.int32),
                        torch.tensor([[as_int32(0xECA86420)]], dtype=torch.int32),
                        torch.ones(1, 8, dtype=torch.float16), group_size=1)
    assert weight.q.tolist() == [list(range(8))]
    # 0xECA86420 holds 0,2,4,6,8,10,12,14 in slots -> columns 0,8,2,10,4,12,6,14 ... reordered
    assert weight.zeros.tolist() == [[0, 8, 2, 10, 4, 12, 6, 14]]


def test_unpack_gptq_adds_one_to_v1_zeros():
    weight = unpack_gptq(torch.zeros(1, 8, dtype=torch.int32),
                         torch.tensor([[0x77777777]], dtype=torch.int32),
                         torch.ones(1, 8, dtype=torch.float16), torch.zeros(8), bits=4)
    assert weight.zeros.tolist() == [[8.0] * 8]


def test_pack_rejects_values_out_of_range_and_unpackable_sizes():
    with pytest.raises(ValueError, match=r"must lie in \[0, 15\]"):
        pack_int32(torch.tensor([[16]] * 8), bits=4, dim=0)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        pack_int32(torch.zeros(6, 2, dtype=torch.int64), bits=4, dim=0)
    with pytest.raises(ValueError, match="bits must be one of 2, 4, 8"):
        pack_int32(torch.zeros(6, 2, dtype=torch.int64), bits=3, dim=0)


@pytest.mark.parametrize("seed", range(40))
def test_unpack_of_pack_is_identity(seed):
    rng = torch.Generator().manual_seed(seed)

    def pick(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=rng))

    bits, dim, groups, other = (2, 4, 8)[pick(3)], pick(2), 1 + pick(3), 1 + pick(5)
    per_word = 32 // bits
    shape = [other, other]
    shape[dim] = groups * per_word
    values = torch.randint(0, 1 << bits, shape, generator=rng)
    order = AWQ_ORDER if bits == 4 and pick(2) else None
    packed = pack_int32(values, bits, dim, order)
    assert packed.dtype == torch.int32 and packed.shape[dim] == groups
    assert torch.equal(unpack_int32(packed, bits, dim, order), values.to(torch.int32))
