"""Kernels compiled for the H200's sm_90 in a child process without TRITON_INTERPRET (no GPU
needed): the fused rotary + cache write, the paged-attention kernels over an fp8 cache, the
split-K GEMVs (bf16, W4A16), the FP8 activation quantization, alone and fused into RMSNorm and
SiLU-and-mul, the W8A8 int8 quantization and GEMM.

The interpreter runs kernels as Python, so what only the compiler enforces (constexpr
globals, dtypes passed to nested jit functions, atomics' memory semantics, e4m3 conversions)
is checked here, and the PTX is searched for the instructions the design relies on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

I32 = "i32"


def compile_for_sm90(module: str, kernel: str, sig: dict, constexprs: dict,
                    launch: str | None = None) -> str:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = getattr(importlib.import_module(module), kernel)
    # constexprs left out take their defaults (as a launch does)
    constexprs = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default
                  } | constexprs
    # arguments not named in sig (strides, sizes) are i32
    sig = {name: "constexpr" if name in constexprs else sig.get(name, I32)
           for name in fn.arg_names}
    # launch: the name of the module's dict of launch options (as the kernel is launched)
    options = getattr(importlib.import_module(module), launch) if launch else {}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=2) | options)
    return compiled.asm["ptx"]


def _gemv_whole_k(x: str = "*bf16", pdl: bool = False) -> tuple:
    sig = {"x_ptr": x, "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "out_ptr": x}
    return ("kvfleet_kernels.w4a16", "_w4a16_gemv_whole_k_kernel", sig,
            dict(BITS=4, BLOCK_N=16, BLOCK_KW=128, F16X2=True, PDL=pdl))


def _gemv_rows(rows: int) -> tuple:
    module, _, sig, constexprs = _gemv_whole_k()
    return module, "_w4a16_gemv_rows_kernel", sig, constexprs | dict(ROWS=rows)


def _rotary_and_cache(cache: str, pdl: bool = False) -> tuple:
    sig = {"positions_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
           "q_out_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache,
           "slot_mapping_ptr": "*i64", "cos_sin_ptr": "*fp32", "k_inv_scale": "fp32",
           "v_inv_scale": "fp32"}
    constexprs = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_SIZE=128, ROT_DIM=128, IS_NEOX=True,
                      BLOCK_SIZE=16, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64, BLOCK_REST=1,
                      BLOCK_D=128, PDL=pdl)
    return "kvfleet_kernels.rotary", "_rotary_and_cache_kernel", sig, constexprs


def _gemv(f16x2: bool = False, x: str = "*bf16", even: bool = True, prefetch: bool = False,
          pdl: bool = False, gated: bool = False) -> tuple:
    sig = {"x_ptr": x, "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16",
           "out_ptr": x, "part_ptr": "*fp32", "count_ptr": "*i32", "act_ptr": x,
           "pair_ptr": "*i32"}
    return ("kvfleet_kernels.w4a16", "_w4a16_gemv_kernel", sig,
            dict(BITS=4, BLOCK_N=128, BLOCK_KW=16, F16X2=f16x2, EVEN=even, PREFETCH=prefetch,
                 PDL=pdl, GATED=gated))


def _gemv_bf16(weight: str = "*bf16", prefetch: bool = False, pdl: bool = False,
               **flags: bool | int) -> tuple:
    sig = {"x_ptr": "*bf16", "w_ptr": weight, "s_ptr": "*fp32", "b_ptr": "*bf16",
           "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "bases_ptr": "*i64",
           "push_offset": "i64"}
    return ("kvfleet_kernels.gemv", "_gemv_kernel", sig,
            dict(HAS_BIAS=not flags.get("PUSH_WORLD"), HAS_SCALE=weight == "*fp8e4nv",
                 BLOCK_N=16, BLOCK_K=512, PREFETCH=prefetch, PDL=pdl, **flags))


def _paged_attention(kernel: str, **flags: bool) -> tuple:
    # bf16 queries and K/V, an e4m3 cache (the H200's sm_90 converts e4m3 only from sm_89 on)
    sig = {"key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv",
           "v_cache_ptr": "*fp8e4nv", "slot_mapping_ptr": "*i64", "q_ptr": "*bf16",
           "out_ptr": "*bf16", "out_index_ptr": "*i32", "part_out_ptr": "*fp32",
           "part_lse_ptr": "*fp32",
           "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
           "scale_log2": "fp32", "v_scale": "fp32", "k_inv_scale": "fp32", "v_inv_scale": "fp32"}
    constexprs = {
        "_reshape_and_cache_kernel": dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128,
                                          BLOCK_SIZE=16),
        "_decode_kernel": dict(NUM_HEADS=32, GROUP=4, GROUP_PAD=16, BLOCK_N=64, HEAD_DIM=128,
                               BLOCK_SIZE=16, K_BY_ROWS=False, DOT_FP16=False),
        "_prefill_kernel": dict(GROUP=4, TOKENS_PER_TILE=32, BLOCK_M=128, BLOCK_N=32,
                                HEAD_DIM=128, BLOCK_SIZE=16, DOT_FP16=False),
        "_decode_reduce_kernel": dict(NUM_HEADS=32, HEAD_DIM=128, SPLITS_PAD=4)}[kernel] | flags
    return "kvfleet_kernels.paged_attention", kernel, sig, constexprs


def _moe_gemm(weight: str, out: str, **flags: bool | int) -> tuple:
    sig = {"a_ptr": "*bf16", "w_ptr": weight, "out_ptr": out, "sorted_pairs_ptr": "*i32",
           "block_experts_ptr": "*i32", "weights_ptr": "*fp32", "scale_ptr": "*fp32"}
    return ("kvfleet_kernels.moe", "_moe_gemm_kernel", sig,
            dict(A_DIV=1, MUL_WEIGHT=False, NUM_EXPERTS=128, BLOCK_M=64, BLOCK_N=64,
                 BLOCK_K=64) | flags)


def _moe_gemv(kernel: str, bits: int, one_group: bool, **flags: bool) -> tuple:
    # the few-token path's kernels over int4 / int8 experts (IntExperts' words)
    sig = {"x_ptr": "*bf16", "act_ptr": "*bf16", "w_ptr": "*i32", "ids_ptr": "*i64",
           "weights_ptr": "*fp32", "out_ptr": "*bf16", "scale_ptr": "*fp16", "zero_ptr": "*fp16"}
    return ("kvfleet_kernels.moe", kernel, sig,
            dict(TOP_K=8, W_SCALE=False, BLOCK_N=16, BLOCK_K=256, BITS=bits,
                 ONE_GROUP=one_group) | flags)


def _row_quant(one_pass: bool, int8: bool = False) -> tuple:
    sig = {"x_ptr": "*bf16", "q_ptr": "*i8" if int8 else "*fp8e4nv", "s_ptr": "*fp32"}
    return ("kvfleet_kernels.quant_row", "_quantize_rows_kernel", sig,
            dict(BLOCK=4096, ONE_PASS=one_pass, INT8=int8))


def _int8_gemm(block_m: int, block_n: int, block_k: int, even_k: bool) -> tuple:
    sig = {"a_ptr": "*i8", "b_ptr": "*i8", "c_ptr": "*bf16", "as_ptr": "*fp32",
           "bs_ptr": "*fp32", "bias_ptr": "*bf16"}
    return ("kvfleet_kernels.int8", "_int8_gemm_kernel", sig,
            dict(HAS_BIAS=True, EVEN_K=even_k, BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_K=block_k, GROUP_M=8), "GEMM_LAUNCH")


def _rms_norm(fp8: bool = True, pdl: bool = False, int8: bool = False, **flags: bool) -> tuple:
    sig = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16",
           "out_ptr": "*fp8e4nv" if fp8 else "*i8" if int8 else "*bf16", "sum_ptr": "*bf16",
           "scale_ptr": "*fp32", "eps": "fp32", "perm_ptr": "*i32"}
    return ("kvfleet_kernels.norm", "_rms_norm_kernel", sig,
            dict(D=4096, BLOCK_D=4096, HAS_RESIDUAL=True, FP8_OUT=fp8, PDL=pdl, INT8_OUT=int8)
            | flags)


def _silu_and_mul(pdl: bool) -> tuple:
    return ("kvfleet_kernels.activation", "_silu_and_mul_kernel",
            {"x_ptr": "*bf16", "out_ptr": "*bf16"}, dict(INTER=14336, BLOCK=1024, PDL=pdl))


def _silu_and_mul_fp8(one_pass: bool, fast: bool = False, int8: bool = False) -> tuple:
    sig = {"x_ptr": "*bf16", "q_ptr": "*i8" if int8 else "*fp8e4nv", "s_ptr": "*fp32"}
    return ("kvfleet_kernels.activation", "_silu_and_mul_quant_kernel", sig,
            dict(INTER=14336, BLOCK=16384, ONE_PASS=True, FAST=fast, INT8=int8) if one_pass
            else dict(INTER=29568, BLOCK=4096, ONE_PASS=False, INT8=int8))


BF16_MMA = ".f32.bf16.bf16"     # tensor-core dots on bf16 operands (mma.sync and wgmma)
F16_MMA = ".f32.f16.f16"
INT_TO_FLOAT = "1258291200"    # 0x4B000000: 2**23 as fp32 bits

# case -> (kernel spec, PTX fragments that must appear)
CASES = {
    "rotary_and_cache_fp8": (_rotary_and_cache("*fp8e4nv"), ["cvt.rn.satfinite.e4m3x2"]),
    "rotary_and_cache_bf16": (_rotary_and_cache("*bf16"), ["st.global"]),
    # the last-arrival reduction: a CTA barrier, then an acq_rel atomic at GPU scope
    "w4a16_gemv": (_gemv(), ["bar.sync", "atom.global.gpu.acq_rel.add", "atom.global.gpu.relaxed.exch"]),
    # the fp16x2 dequantization: lop3 into fp16 1024s, fp16x2 fmas, bf16 x saturated into fp16
    # pairs (fp16 x: byte permutes), the pair sums widened to fp32
    "w4a16_gemv_f16x2_bf16": (_gemv(True), ["lop3.b32", "fma.rn.f16x2", "mul.rn.f16x2",
                                             "cvt.rn.satfinite.f16x2.f32", "cvt.f32.f16",
                                             "atom.global.gpu.acq_rel.add"]),
    "w4a16_gemv_f16x2_fp16_masked": (_gemv(True, "*fp16", even=False),
                                     ["lop3.b32", "fma.rn.f16x2", "prmt.b32", "cvt.f32.f16"]),
    # the next tile's loads issued ahead of this one's arithmetic, masked and not
    "w4a16_gemv_f16x2_prefetch": (_gemv(True, prefetch=True),
                                  ["lop3.b32", "fma.rn.f16x2", "atom.global.gpu.acq_rel.add"]),
    "w4a16_gemv_f16x2_prefetch_masked": (_gemv(True, "*fp16", even=False, prefetch=True),
                                         ["lop3.b32", "fma.rn.f16x2", "prmt.b32"]),
    # the whole-K GEMV: the same dequantization, the warps' row sums met through shared memory
    "w4a16_gemv_whole_k_bf16": (_gemv_whole_k(), ["lop3.b32", "fma.rn.f16x2", "cvt.f32.f16",
                                                  "bar.sync"]),
    "w4a16_gemv_whole_k_fp16": (_gemv_whole_k("*fp16"), ["lop3.b32", "prmt.b32"]),
    "gemv_bf16": (_gemv_bf16(), ["bar.sync", "atom.global.gpu.acq_rel.add"]),
    # fp8 weights (W8A16 at batch 1): e4m3 read through the paired half-precision convert
    "gemv_fp8_weight": (_gemv_bf16("*fp8e4nv"), ["cvt.rn.f16x2.e4m3x2", "atom.global.gpu.acq_rel.add"]),
    "gemv_bf16_prefetch": (_gemv_bf16(prefetch=True), ["bar.sync", "atom.global.gpu.acq_rel.add"]),
    "gemv_fp8_weight_prefetch": (_gemv_bf16("*fp8e4nv", prefetch=True), ["cvt.rn.f16x2.e4m3x2"]),
    # SiLU(gate) * up computed as the input tiles are loaded (silu_mul_row: an exp, a
    # division, rounded to bf16; the same divisions as the activation kernel: test below)
    "gemv_bf16_gated": (_gemv_bf16(prefetch=True, GATED=True), ["ex2.approx.f32", "cvt.rn.bf16"]),
    # the outputs also stored into the peers' buffers, at addresses loaded from bases_ptr
    "gemv_bf16_push": (_gemv_bf16(prefetch=True, PUSH_WORLD=2), ["ld.global.b64", "st.global"]),
    # the fp8 cache: writes saturate and round to nearest, reads convert e4m3 to half precision
    "reshape_and_cache_fp8": (_paged_attention("_reshape_and_cache_kernel"),
                              ["cvt.rn.satfinite.e4m3x2"]),
    # bf16 dots, or fp16 dots (the query converted once), K gathered as [D, N] or loaded by rows
    "decode_fp8": (_paged_attention("_decode_kernel"), ["cvt.rn.f16x2.e4m3x2", BF16_MMA]),
    "decode_fp8_fp16_dots": (_paged_attention("_decode_kernel", DOT_FP16=True),
                             ["cvt.rn.f16x2.e4m3x2", F16_MMA]),
    "decode_fp8_k_by_rows": (_paged_attention("_decode_kernel", DOT_FP16=True, K_BY_ROWS=True),
                             ["cvt.rn.f16x2.e4m3x2", F16_MMA]),
    "prefill_fp8": (_paged_attention("_prefill_kernel"), ["cvt.rn.f16x2.e4m3x2", BF16_MMA]),
    # split contexts merged by their last partition: a CTA barrier, then an acq_rel count
    "prefill_fp8_fp16_dots": (_paged_attention("_prefill_kernel", DOT_FP16=True),
                              ["cvt.rn.f16x2.e4m3x2", F16_MMA]),
    # sliding-window attention (per-row window bounds; decode's partitions from the window's tile)
    "prefill_fp8_sliding": (_paged_attention("_prefill_kernel", DOT_FP16=True, SLIDING=True),
                            ["cvt.rn.f16x2.e4m3x2", F16_MMA]),
    "decode_fp8_sliding": (_paged_attention("_decode_kernel", DOT_FP16=True, SLIDING=True,
                                            PRELOAD=True), ["cvt.rn.f16x2.e4m3x2", F16_MMA]),
    "decode_reduce_sliding": (_paged_attention("_decode_reduce_kernel", SLIDING=True,
                                               BLOCK_N=64), ["ex2.approx"]),
    # heads of 96 dims (Phi-3-mini) in tiles of 128, the pad masked
    "prefill_fp8_96_dims": (_paged_attention("_prefill_kernel", DOT_FP16=True, D_REAL=96),
                            ["cvt.rn.f16x2.e4m3x2", F16_MMA]),
    "decode_fp8_96_dims": (_paged_attention("_decode_kernel", DOT_FP16=True, D_REAL=96,
                                            V_TOKEN_MAJOR=True, PRELOAD=True),
                           ["cvt.rn.f16x2.e4m3x2", F16_MMA]),
    # the output's columns stored through out_index (an act-order o_proj's input order), by
    # the single-partition decode, the reduce of split ones, and prefill
    "decode_fp8_out_index": (_paged_attention("_decode_kernel", DOT_FP16=True, OUT_INDEX=True),
                             ["cvt.rn.f16x2.e4m3x2", F16_MMA]),
    "decode_reduce_out_index": (_paged_attention("_decode_reduce_kernel", OUT_INDEX=True),
                                ["ex2.approx"]),
    "prefill_fp8_out_index": (_paged_attention("_prefill_kernel", DOT_FP16=True, OUT_INDEX=True),
                              ["cvt.rn.f16x2.e4m3x2", F16_MMA]),
    # the mixture of experts' grouped GEMM: bf16 experts, and e4m3 ones read as bf16 (W8A16)
    "moe_gemm_bf16": (_moe_gemm("*bf16", "*bf16", A_DIV=8), [BF16_MMA]),
    "moe_gemm_fp8_weights": (_moe_gemm("*fp8e4nv", "*fp32", MUL_WEIGHT=True, W_SCALE=True),
                             [BF16_MMA, "cvt.rn.f16x2.e4m3x2"]),
    # act-order int experts: each pair's input row gathered through its expert's permutation
    "moe_gather_pairs": (("kvfleet_kernels.moe", "_gather_pairs_kernel",
                          {"v_ptr": "*bf16", "perm_ptr": "*i32", "ids_ptr": "*i64",
                           "out_ptr": "*bf16"}, dict(PER_ROW=8, BLOCK=1024)), ["ld.global.b32"]),
    # int experts' GEMV, dotted word by word: each value made a float by the exponent trick
    # (w4a16's _small_int_to_float: or'ed into 2**23's bits), no int-to-float conversion
    "moe_gemv_up_int4": (_moe_gemv("_moe_up_kernel", 4, True, EVEN_K=True, V_QUADS=True),
                         [INT_TO_FLOAT]),
    "moe_gemv_up_int4_groups": (_moe_gemv("_moe_up_kernel", 4, False), [INT_TO_FLOAT]),
    "moe_gemv_down_int8": (_moe_gemv("_moe_down_kernel", 8, True, V_QUADS=True),
                           [INT_TO_FLOAT]),
    "moe_gemv_down_int4_values": (_moe_gemv("_moe_down_kernel", 4, False), [INT_TO_FLOAT]),
    "fp8_quant_one_pass": (_row_quant(True), ["div.rn.f32", "cvt.rn.satfinite.e4m3x2"]),
    # W8A8: the per-token int8 quantization (IEEE division, floor-based rounding), and the int8
    # GEMM on the integer tensor cores (s8 x s8 -> s32) at its prefill and decode tiles
    "int8_quant_one_pass": (_row_quant(True, int8=True), ["div.rn.f32", "cvt.rmi"]),
    "int8_quant_two_pass": (_row_quant(False, int8=True), ["div.rn.f32", "cvt.rmi"]),
    "int8_gemm_prefill": (_int8_gemm(128, 128, 128, True), [".s32.s8.s8", "cvt.rn.bf16"]),
    "int8_gemm_decode_ragged_k": (_int8_gemm(16, 64, 256, False), [".s32.s8.s8"]),
    "fp8_quant_two_pass": (_row_quant(False), ["div.rn.f32", "cvt.rn.satfinite.e4m3x2"]),
    # the same quantization (quant_row's row_scale / row_quantize) inside the producers' kernels,
    # of the output rounded to bf16 first (what the unfused kernel writes)
    "rms_norm_fp8": (_rms_norm(), ["cvt.rn.bf16", "div.rn.f32", "cvt.rn.satfinite.e4m3x2"]),
    # an act-order consumer's column order: the row's columns gathered through shared memory,
    # then stored in order
    "rms_norm_out_perm": (_rms_norm(fp8=False, OUT_PERM=True), ["st.shared", "ld.shared"]),
    "silu_and_mul_fp8_one_pass": (_silu_and_mul_fp8(True),
                                  ["cvt.rn.bf16", "div.rn.f32", "cvt.rn.satfinite.e4m3x2"]),
    "silu_and_mul_fp8_two_pass": (_silu_and_mul_fp8(False),
                                  ["cvt.rn.bf16", "div.rn.f32", "cvt.rn.satfinite.e4m3x2"]),
    # the GPU default for one-pass rows: SiLU's division approximate (div.full), the values
    # multiplied by the row's inverse scale (one IEEE division a row, counted below)
    "silu_and_mul_fp8_fast": (_silu_and_mul_fp8(True, fast=True),
                              ["cvt.rn.bf16", "div.full.f32", "cvt.rn.satfinite.e4m3x2"]),
    # W8A8: the int8 quantization inside the producers' kernels (row_scale / row_quantize to
    # int8: floor-based rounding half to even)
    "rms_norm_int8": (_rms_norm(fp8=False, int8=True), ["cvt.rn.bf16", "div.rn.f32", "cvt.rmi"]),
    "silu_and_mul_int8_two_pass": (_silu_and_mul_fp8(False, int8=True),
                                   ["cvt.rn.bf16", "div.rn.f32", "cvt.rmi"]),
    "silu_and_mul_int8_fast": (_silu_and_mul_fp8(True, fast=True, int8=True),
                               ["cvt.rn.bf16", "div.full.f32", "cvt.rmi"]),
}
# what a kernel's PTX must not hold: the int8 GEMM's epilogue rounds the scales' product before
# the bias add (int8_scale_ref's order; fused into an FMA it differed in the last bit on an H100)
ABSENT = {"int8_gemm_prefill": ["fma.rn.f32"], "int8_gemm_decode_ragged_k": ["fma.rn.f32"]}
# kernels whose IEEE divisions are counted: at most this many div.rn.f32 in their PTX
MAX_IEEE_DIVISIONS = {"silu_and_mul_fp8_fast": 1, "silu_and_mul_int8_fast": 1}

# programmatic dependent launch (kvfleet_kernels.pdl): each decode-step kernel compiled with
# PDL waits for the previous kernel and then lets the next launch; the prefetching GEMVs load
# their first weight tile before that wait (_PDL_LOADS_FIRST)
_PDL = ["griddepcontrol.wait", "griddepcontrol.launch_dependents"]
PDL_CASES = {
    "gemv_bf16_pdl": (_gemv_bf16(pdl=True), _PDL),
    "gemv_bf16_prefetch_pdl": (_gemv_bf16(prefetch=True, pdl=True), _PDL),
    "gemv_bf16_gated_push_pdl": (_gemv_bf16(prefetch=True, pdl=True, GATED=True, PUSH_WORLD=2),
                                 _PDL),
    "gemv_fp8_weight_prefetch_pdl": (_gemv_bf16("*fp8e4nv", prefetch=True, pdl=True), _PDL),
    "w4a16_gemv_f16x2_prefetch_pdl": (_gemv(True, prefetch=True, pdl=True), _PDL),
    "w4a16_gemv_f16x2_pdl": (_gemv(True, pdl=True), _PDL),
    "w4a16_gemv_gated_pdl": (_gemv(True, prefetch=True, pdl=True, gated=True),
                             [*_PDL, "ex2.approx.f32", "atom.global.gpu.acq_rel.add"]),
    "w4a16_gemv_whole_k_pdl": (_gemv_whole_k(pdl=True), _PDL),
    "rms_norm_pdl": (_rms_norm(fp8=False, pdl=True), _PDL),
    "rms_norm_fp8_pdl": (_rms_norm(pdl=True), _PDL),
    "silu_and_mul_pdl": (_silu_and_mul(True), _PDL),
    "rotary_and_cache_pdl": (_rotary_and_cache("*bf16", pdl=True), _PDL),
    "decode_pdl": (_paged_attention("_decode_kernel", PDL=True), _PDL),
    "decode_preload_pdl": (_paged_attention("_decode_kernel", PDL=True, PRELOAD=True), _PDL),
    "decode_reduce_pdl": (_paged_attention("_decode_reduce_kernel", PDL=True), _PDL),
    # and without PDL, none of it
    "rms_norm_no_pdl": (_rms_norm(fp8=False), []),
    "gemv_bf16_prefetch_no_pdl": (_gemv_bf16(prefetch=True), []),
}
_PDL_LOADS_FIRST = ["gemv_bf16_prefetch_pdl", "gemv_fp8_weight_prefetch_pdl",
                    "w4a16_gemv_f16x2_prefetch_pdl", "w4a16_gemv_whole_k_pdl",
                    "w4a16_gemv_gated_pdl", "decode_preload_pdl", "decode_reduce_pdl"]


def _compile_in_child(loop: str) -> str:
    """Run `loop` (Python over this module as `t`) in a child without TRITON_INTERPRET, so
    Triton compiles for real; its stdout."""
    here = Path(__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parents[1] / "kernels"),
                                         env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", "import test_kernel_compile_sm90 as t\n" + loop],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_kernels_compile_for_sm90() -> None:
    out = _compile_in_child("for case, (spec, needles) in t.CASES.items():\n"
                            "    ptx = t.compile_for_sm90(*spec)\n"
                            "    print(case, 'div.rn', ptx.count('div.rn.f32'))\n"
                            "    for n in needles + t.ABSENT.get(case, []):\n"
                            "        print(case, repr(n), n in ptx)\n")
    for case, (_, needles) in CASES.items():
        for n in needles:
            assert f"{case} {n!r} True" in out, out
        for n in ABSENT.get(case, []):
            assert f"{case} {n!r} False" in out, out
    for case, most in MAX_IEEE_DIVISIONS.items():
        count = int(out.split(f"{case} div.rn ")[1].split()[0])
        assert count <= most, out


@pytest.mark.slow
def test_pdl_kernels_compile_for_sm90() -> None:
    out = _compile_in_child(
        "for case, (spec, needles) in t.PDL_CASES.items():\n"
        "    ptx = t.compile_for_sm90(*spec)\n"
        "    print(case, 'griddepcontrol', 'griddepcontrol' in ptx)\n"
        "    for n in needles:\n"
        "        print(case, repr(n), n in ptx)\n"
        "    if case in t._PDL_LOADS_FIRST:\n"
        "        print(case, 'load-first', ptx.index('ld.global') < ptx.index('griddepcontrol.wait'))\n")
    for case, (_, needles) in PDL_CASES.items():
        assert f"{case} griddepcontrol {bool(needles)}" in out, out
        for n in needles:
            assert f"{case} {n!r} True" in out, out
    for case in _PDL_LOADS_FIRST:
        assert f"{case} load-first True" in out, out


@pytest.mark.slow
def test_the_whole_k_gemv_has_no_slices_to_meet() -> None:
    # no partials in global memory, no arrival counter: the K rows meet inside the program
    out = _compile_in_child("ptx = t.compile_for_sm90(*t._gemv_whole_k())\n"
                            "print('atom', 'atom.' in ptx, 'st.global', ptx.count('st.global'))\n")
    assert "atom False" in out, out
    assert "st.global 1" in out or "st.global 2" in out, out     # the output only


@pytest.mark.slow
def test_per_step_integers_are_no_specialisation_keys() -> None:
    # a block table's width and whether decode splits contexts change from step to step; as
    # Triton specialisation keys (divisible by 16, equal to 1) they compiled the attention
    # kernels again inside a running batch (1.5-2.7 s each on the H200)
    out = _compile_in_child(
        "from kvfleet_kernels import paged_attention as pa\n"
        "for name in ('_prefill_kernel', '_decode_kernel'):\n"
        "    print(name, sorted(p.name for p in getattr(pa, name).params if p.do_not_specialize))\n")
    assert "_prefill_kernel ['stride_bt']" in out, out
    assert "_decode_kernel ['num_splits', 'stride_bt']" in out, out


@pytest.mark.slow
def test_the_gated_gemv_divides_as_the_activation_kernel() -> None:
    # the same bits as silu_and_mul then the GEMV (checked on the H200 by test_kernel_gemv.py)
    # need the same division instruction, whichever one this Triton picks for `/`
    out = _compile_in_child(
        "import re\n"
        "for case, spec in (('gated', t.CASES['gemv_bf16_gated'][0]), ('act', t._silu_and_mul(False))):\n"
        "    print(case, sorted(set(re.findall(r'div\\.[a-z0-9.]+', t.compile_for_sm90(*spec)))))\n")
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("gated", "act")))
    assert lines["gated"] == lines["act"] and lines["act"] != "[]", out


@pytest.mark.slow
def test_fp8_decode_reads_a_token_major_v_without_byte_loads() -> None:
    # P @ V reduces over keys. V in rows (keys 128 bytes apart) reached the tensor cores' operand
    # through byte-wise shared-memory reads (no transposing ldmatrix for 8-bit elements);
    # token-major V (paged_attention.token_major_v, the engine's fp8 layout) needs none
    out = _compile_in_child(
        "for vt in (False, True):\n"
        "    for pre in (False, True):\n"
        "        spec = t._paged_attention('_decode_kernel', DOT_FP16=True, V_TOKEN_MAJOR=vt,\n"
        "                                  PRELOAD=pre)\n"
        "        print('token-major' if vt else 'rows', pre, t.compile_for_sm90(*spec).count('ld.shared.b8'))\n")
    counts = {tuple(line.split()[:2]): int(line.split()[2]) for line in out.splitlines()
              if line.startswith(("rows", "token-major"))}
    assert counts[("rows", "False")] > 0 and counts[("rows", "True")] > 0, out
    assert counts[("token-major", "False")] == 0 == counts[("token-major", "True")], out


@pytest.mark.slow
def test_several_rows_a_program_dequantize_once():
    # KVFLEET_W4A16_GEMV=rows=R: the words' fp16x2 dequantization (lop3) once for the R rows,
    # a row's products (one mul.rn.f16x2 a word pair, then fmas) per row
    out = _compile_in_child(
        "for name, spec in (('one', t._gemv_whole_k()), ('rows2', t._gemv_rows(2)),\n"
        "                   ('rows4', t._gemv_rows(4))):\n"
        "    ptx = t.compile_for_sm90(*spec)\n"
        "    print(name, ptx.count('lop3.b32'), ptx.count('mul.rn.f16x2'))\n")
    counts = {line.split()[0]: tuple(map(int, line.split()[1:])) for line in out.splitlines()
              if line.startswith(("one", "rows"))}
    lop3, mul = counts["one"]
    assert lop3 > 0 and mul > 0, out
    assert counts["rows2"] == (lop3, 2 * mul) and counts["rows4"] == (lop3, 4 * mul), out
