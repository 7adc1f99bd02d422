import torch
from kvfleet_kernels.w4a16 import dequantize, dequantize_ref, w4a16_gemm
from kvfleet_runtime.layers.quantization.packing import pack_int32
g = torch.Generator(device="cuda").manual_seed(257)
k, n = 4096, 6144
q = torch.randint(0, 16, (k, n), device="cuda", generator=g)
scales = (torch.rand(32, n, device="cuda", generator=g) * 0.02 + 1e-3).half()
zeros = torch.randint(0, 16, (32, n), device="cuda", generator=g).half()
qw = pack_int32(q, 4, dim=0)
x = torch.randn(256, k, device="cuda", dtype=torch.bfloat16)
d = dequantize(qw, scales, zeros, 4, 128, torch.bfloat16)
r = dequantize_ref(qw, scales, zeros, 4, 128)
print("dequant equal", torch.equal(d, r.to(torch.bfloat16)), (d.float() - r).abs().max().item())
a = torch.matmul(x, d); b = torch.matmul(x, r.to(torch.bfloat16)); c = torch.matmul(x, d.clone())
print("matmul equal", torch.equal(a, b), torch.equal(a, c), (a - b).abs().max().item())
o = w4a16_gemm(x, qw, scales, zeros, 4, 128)
print("route equal", torch.equal(o, a), (o - a).abs().max().item())
