"""A floor for a persistent batch-1 decode kernel (issue 7): the four W4A16 GEMVs of the
Llama-3.1-8B layer (qkv -> o -> gate_up with SiLU(gate) * up -> down), chained over the
model's layers, timed two ways over the same 4-bit weights (L2-cold: every layer its own):

  launches    as the engine runs them: w4a16_gemm at its defaults (qkv, o and down through
              the whole-K GEMV over column-blocked weights, gate_up through the split GEMV
              writing SiLU(gate) * up), PDL between the launches, one CUDA graph
  persistent  one launch of resident programs (programs a SM x SMs) that meet at a grid-wide
              barrier (a counter in global memory) after each projection; a program loads its
              first weights of the next projection before it waits (as the PDL kernels do
              before griddepcontrol.wait), then the input; the whole-K GEMV's code (the same
              16-column blocks and 2048-row steps) for all four, gate_up a gate block and its
              up block a program, writing the activation itself
  no barrier  the persistent launch with the waits left out (inputs not ready: wrong
              results): what the weights' streaming alone costs in that launch

No attention, norms, rotary or residuals: what the GEMVs cost with and without kernel
boundaries between them, the question a layer-wide kernel answers (docs/PERFORMANCE.md,
issue-7 section). Each projection of the persistent launch is checked against w4a16_gemm on
the same input (within 2% of the output's largest value: gate_up sums in another order). Not a
test; GPU only (a barrier needs every program resident: a program that waits too long sets a
flag, and the run reports it instead of hanging).

    python tests/quantization/bench_w4a16_persistent.py [--layers 32] [--per-sm 1 2 3]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "kernels"))
from bench_w4a16 import graph_us  # noqa: E402  (CUDA-graph replays, as decode runs)
from kvfleet_kernels.w4a16 import (  # noqa: E402
    _whole_k_weights,
    _word_pair_sums,
    block_columns,
    w4a16_gemm,
)

HIDDEN, QKV, INTER = 4096, 6144, 14336
GROUP = 128
BLOCK_N, BLOCK_K = 16, 2048            # the whole-K GEMV's default tiles at these shapes
BLOCK_KW = BLOCK_K // 8
# a wait's polls (~1 us each) before it gives up: the programs are not all resident
MAX_SPINS: tl.constexpr = tl.constexpr(1 << 16)


@triton.jit
def _load_x(x64, step, BLOCK_KW: tl.constexpr, F16X2: tl.constexpr):
    # one step's activations as int64 quads (_gemv_load_x's), past L1: another program wrote
    # them (not F16X2: zeros, unused)
    row_a = (step * BLOCK_KW + 2 * tl.arange(0, BLOCK_KW // 2))[:, None]
    if not F16X2:
        zero = tl.zeros((BLOCK_KW // 2, 1), dtype=tl.int64)
        return zero, zero, zero, zero
    return (tl.load(x64 + row_a * 2, cache_modifier=".cg"),
            tl.load(x64 + row_a * 2 + 1, cache_modifier=".cg"),
            tl.load(x64 + row_a * 2 + 2, cache_modifier=".cg"),
            tl.load(x64 + row_a * 2 + 3, cache_modifier=".cg"))


@triton.jit
def _block_dot(x_ptr, qw, s, z, wa, wb, sc, zz, K, group_size,
               BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, F16X2: tl.constexpr):
    # one column block over the whole of K (the whole-K GEMV's loop), its first step's
    # weights (wa, wb, sc, zz) already loaded: fp32 [BLOCK_N]. F16X2: the GPU's fp16x2 PTX
    # (else fp32 Triton, the interpreter's path, which loads x where it multiplies)
    kw = K // 8
    n_steps = kw // BLOCK_KW
    cols = tl.arange(0, BLOCK_N)[None, :]
    x64 = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    acc = tl.zeros((BLOCK_KW // 2, BLOCK_N), dtype=tl.float32)
    xa01, xa23, xb01, xb23 = _load_x(x64, 0, BLOCK_KW, F16X2)
    for step in range(0, n_steps - 1):
        na, nb, ns, nz = _whole_k_weights(qw, s, z, step + 1, group_size, BLOCK_N, BLOCK_N,
                                          cols, BLOCK_KW, 8)
        nxa01, nxa23, nxb01, nxb23 = _load_x(x64, step + 1, BLOCK_KW, F16X2)
        acc += _word_pair_sums(wa, wb, zz, xa01, xa23, xb01, xb23, step, x_ptr, kw, 4,
                               BLOCK_KW, F16X2, True) * sc
        wa, wb, sc, zz = na, nb, ns, nz
        xa01, xa23, xb01, xb23 = nxa01, nxa23, nxb01, nxb23
    acc += _word_pair_sums(wa, wb, zz, xa01, xa23, xb01, xb23, n_steps - 1, x_ptr, kw, 4,
                           BLOCK_KW, F16X2, True) * sc
    y = tl.sum(acc, axis=0)
    if F16X2:
        y = y * 16.0
    return y


@triton.jit
def _wait(cnt_ptr, flag_ptr, target, WAIT: tl.constexpr):
    # until target arrivals are counted (acquire: their stores visible to this program)
    if WAIT:
        c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        spins = 0
        while (c < target) & (spins < MAX_SPINS):
            c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
            spins += 1
        if spins >= MAX_SPINS:
            tl.atomic_xchg(flag_ptr, 1)
        tl.debug_barrier()


@triton.jit
def _arrive(cnt_ptr):
    # every thread's stores precede one thread's count (release, cumulative over the barrier)
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _projection(x_ptr, qw, s, z, out_ptr, K, N, group_size, cnt_ptr, flag_ptr, target,
                PAIRED: tl.constexpr, WAIT: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_KW: tl.constexpr, F16X2: tl.constexpr):
    # this program's column blocks pid, pid + programs, ... of a column-blocked [K, N] weight
    # (PAIRED: gate block b with up block b + N / 2 / BLOCK_N, writing SiLU(gate) * up)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    stride_qb = K // 8 * BLOCK_N
    stride_sb = K // group_size * BLOCK_N
    blocks = N // BLOCK_N
    tiles = blocks // 2 if PAIRED else blocks
    cols = tl.arange(0, BLOCK_N)[None, :]
    for b in range(pid, tiles, programs):
        wa, wb, sc, zz = _whole_k_weights(qw + b * stride_qb, s + b * stride_sb,
                                          z + b * stride_sb, 0, group_size, BLOCK_N, BLOCK_N,
                                          cols, BLOCK_KW, 8)
        if b == pid:        # the first block's first step is asked for before the wait
            _wait(cnt_ptr, flag_ptr, target, WAIT)
        y = _block_dot(x_ptr, qw + b * stride_qb, s + b * stride_sb, z + b * stride_sb,
                       wa, wb, sc, zz, K, group_size, BLOCK_N, BLOCK_KW, F16X2)
        offs = b * BLOCK_N + tl.arange(0, BLOCK_N)
        if PAIRED:
            u = b + tiles
            ua, ub, us, uz = _whole_k_weights(qw + u * stride_qb, s + u * stride_sb,
                                              z + u * stride_sb, 0, group_size, BLOCK_N,
                                              BLOCK_N, cols, BLOCK_KW, 8)
            up = _block_dot(x_ptr, qw + u * stride_qb, s + u * stride_sb, z + u * stride_sb,
                            ua, ub, us, uz, K, group_size, BLOCK_N, BLOCK_KW, F16X2)
            # as silu_mul on the rounded outputs
            g = y.to(tl.bfloat16).to(tl.float32)
            up = up.to(tl.bfloat16).to(tl.float32)
            y = g / (1.0 + tl.exp(-g)) * up
        tl.store(out_ptr + offs, y.to(tl.bfloat16))
    if pid >= tiles:        # no block here, but every program waits at every barrier
        _wait(cnt_ptr, flag_ptr, target, WAIT)


@triton.jit
def _chain_kernel(h_ptr, qkv_ptr, o_ptr, act_ptr, cnt_ptr, flag_ptr,
                  qw0, s0, z0, qw1, s1, z1, qw2, s2, z2, qw3, s3, z3, layers, group_size,
                  HIDDEN: tl.constexpr, QKV: tl.constexpr, INTER: tl.constexpr,
                  WAIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                  F16X2: tl.constexpr = True):
    """Every layer's qkv (x: h[l]), o (x: qkv[l]'s first HIDDEN), gate_up (x: o[l]; writes
    act[l]) and down (x: act[l]; writes h[l + 1]), programs meeting after each: the n-th
    projection waits for n x programs arrivals on cnt (zeroed before the launch)."""
    programs = tl.num_programs(0)
    for layer in range(layers):
        phase = layer * 4
        _projection(h_ptr + layer * HIDDEN, qw0 + layer * (QKV * HIDDEN // 8),
                    s0 + layer * (QKV * HIDDEN // group_size),
                    z0 + layer * (QKV * HIDDEN // group_size), qkv_ptr + layer * QKV, HIDDEN,
                    QKV, group_size, cnt_ptr, flag_ptr, phase * programs, False, WAIT,
                    BLOCK_N, BLOCK_KW, F16X2)
        _arrive(cnt_ptr)
        _projection(qkv_ptr + layer * QKV, qw1 + layer * (HIDDEN * HIDDEN // 8),
                    s1 + layer * (HIDDEN * HIDDEN // group_size),
                    z1 + layer * (HIDDEN * HIDDEN // group_size), o_ptr + layer * HIDDEN,
                    HIDDEN, HIDDEN, group_size, cnt_ptr, flag_ptr, (phase + 1) * programs,
                    False, WAIT, BLOCK_N, BLOCK_KW, F16X2)
        _arrive(cnt_ptr)
        _projection(o_ptr + layer * HIDDEN, qw2 + layer * (2 * INTER * HIDDEN // 8),
                    s2 + layer * (2 * INTER * HIDDEN // group_size),
                    z2 + layer * (2 * INTER * HIDDEN // group_size), act_ptr + layer * INTER,
                    HIDDEN, 2 * INTER, group_size, cnt_ptr, flag_ptr, (phase + 2) * programs,
                    True, WAIT, BLOCK_N, BLOCK_KW, F16X2)
        _arrive(cnt_ptr)
        _projection(act_ptr + layer * INTER, qw3 + layer * (HIDDEN * INTER // 8),
                    s3 + layer * (HIDDEN * INTER // group_size),
                    z3 + layer * (HIDDEN * INTER // group_size), h_ptr + (layer + 1) * HIDDEN,
                    INTER, HIDDEN, group_size, cnt_ptr, flag_ptr, (phase + 3) * programs,
                    False, WAIT, BLOCK_N, BLOCK_KW, F16X2)
        _arrive(cnt_ptr)


def make_weights(layers: int, k: int, n: int, dev: torch.device):
    """layers random 4-bit [k, n] weights, each as the checkpoint lays it out (qweight [k / 8,
    n], scales and zeros [k / GROUP, n]; `blocked` stacks them column-blocked); the scales keep
    a projection's output near its input's size (no norms in the chain)."""
    out = []
    for _ in range(layers):
        qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev)
        scales = (torch.rand(k // GROUP, n, device=dev) * (0.4 / k ** 0.5)).half()
        zeros = torch.full((k // GROUP, n), 8, device=dev, dtype=torch.float16)
        out.append((qweight, scales, zeros))
    return out


def blocked(weights) -> tuple[torch.Tensor, ...]:
    """The layers' weights column-blocked and stacked: ([L, n / 16, k / 8, 16], scales, zeros)."""
    return tuple(torch.stack([block_columns(w[i], BLOCK_N) for w in weights])
                 for i in range(3))


def check_steps(h, qkv, o, act, per_layer, gate_up) -> dict[str, float]:
    """Each projection of the persistent launch against w4a16_gemm on the same input (the
    launch's own previous output), per layer: the largest error over the output's largest
    value, per projection (qkv, o and down run the whole-K GEMV's tiles and order either way;
    gate_up the split GEMV's in the launches; a chain of separately rounded layers drifts
    apart, so the chains are not compared whole)."""
    def rel(got, want):
        return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    errors = {"qkv": 0.0, "o": 0.0, "gate_up": 0.0, "down": 0.0}
    for i in range(qkv.shape[0]):
        steps = {"qkv": (qkv[i], w4a16_gemm(h[i:i + 1], *per_layer["qkv"][i], 4, GROUP)),
                 "o": (o[i], w4a16_gemm(qkv[i:i + 1, :HIDDEN], *per_layer["o"][i], 4, GROUP)),
                 "gate_up": (act[i], w4a16_gemm(o[i:i + 1], *gate_up[i], 4, GROUP,
                                                silu_out=True)),
                 "down": (h[i + 1], w4a16_gemm(act[i:i + 1], *per_layer["down"][i], 4, GROUP))}
        for name, (got, want) in steps.items():
            errors[name] = max(errors[name], rel(got, want[0]))
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 3],
                        help="resident programs a SM of the persistent launch")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n_layers = args.layers
    shapes = {"qkv": (HIDDEN, QKV), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * INTER),
              "down": (INTER, HIDDEN)}
    plain = {name: make_weights(n_layers, k, n, dev) for name, (k, n) in shapes.items()}
    stacked = {name: blocked(w) for name, w in plain.items()}
    per_layer = {name: [tuple(t[i] for t in stacked[name]) for i in range(n_layers)]
                 for name in ("qkv", "o", "down")}
    q_bytes = sum(k * n // 2 + k // GROUP * n * 4 for k, n in shapes.values())
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{n_layers} layers, {q_bytes * n_layers / 1e9:.2f} GB of 4-bit weights and scales")

    h0 = torch.randn(1, HIDDEN, device=dev, dtype=torch.bfloat16)

    def launches():
        h = h0
        out = []
        for i in range(n_layers):
            qkv = w4a16_gemm(h, *per_layer["qkv"][i], 4, GROUP)
            o = w4a16_gemm(qkv[:, :HIDDEN], *per_layer["o"][i], 4, GROUP)
            act = w4a16_gemm(o, *plain["gate_up"][i], 4, GROUP, silu_out=True)
            h = w4a16_gemm(act, *per_layer["down"][i], 4, GROUP)
            out.append(h)
        return out

    launches()
    t_launch = graph_us(launches)
    print(f"launches: {t_launch:.1f} us, {t_launch / n_layers:.1f} us a layer, "
          f"{q_bytes * n_layers / t_launch / 1e6:.2f} TB/s")

    h = torch.zeros(n_layers + 1, HIDDEN, device=dev, dtype=torch.bfloat16)
    h[0] = h0[0]
    qkv = torch.zeros(n_layers, QKV, device=dev, dtype=torch.bfloat16)
    o = torch.zeros(n_layers, HIDDEN, device=dev, dtype=torch.bfloat16)
    act = torch.zeros(n_layers, INTER, device=dev, dtype=torch.bfloat16)
    cnt = torch.zeros(1, device=dev, dtype=torch.int32)
    flag = torch.zeros(1, device=dev, dtype=torch.int32)
    weights = [t for name in ("qkv", "o", "gate_up", "down") for t in stacked[name]]
    for per_sm in args.per_sm:
        cap = 65536 // (per_sm * 256) // 8 * 8
        programs = sms * per_sm
        for wait in (True, False):
            def persistent(wait=wait, programs=programs, cap=cap):
                cnt.zero_()
                _chain_kernel[(programs,)](h, qkv, o, act, cnt, flag, *weights, n_layers, GROUP,
                                           HIDDEN=HIDDEN, QKV=QKV, INTER=INTER, WAIT=wait,
                                           BLOCK_N=BLOCK_N, BLOCK_KW=BLOCK_KW, num_warps=8,
                                           num_stages=1, maxnreg=min(cap, 255))
            flag.zero_()
            persistent()
            torch.cuda.synchronize()
            if flag.item():
                print(f"persistent, {per_sm} a SM ({programs} programs, <= {cap} registers): "
                      "a wait gave up (not every program resident); not timed")
                break
            what = "persistent" if wait else "no barrier"
            check = ""
            if wait:
                errors = check_steps(h, qkv, o, act, per_layer, plain["gate_up"])
                check = ", off the launches' on the same inputs by " + ", ".join(
                    f"{name} {err:.1e}" for name, err in errors.items())
                assert max(errors.values()) < 2e-2, check
            t = graph_us(persistent)
            print(f"{what}, {per_sm} a SM ({programs} programs, <= {cap} registers): "
                  f"{t:.1f} us, {t / n_layers:.1f} us a layer, "
                  f"{q_bytes * n_layers / t / 1e6:.2f} TB/s{check}", flush=True)


if __name__ == "__main__":
    main()
