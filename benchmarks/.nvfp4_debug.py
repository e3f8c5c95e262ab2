"""Debug aid (GPU): NVFP4 dequantize, Triton vs torch, every code byte under every scale byte."""

import torch

from leantrain.ops.nvfp4 import NVFP4Tensor, dequantize_nvfp4, dequantize_nvfp4_ref

data = torch.arange(256, dtype=torch.uint8).repeat(8)
q = NVFP4Tensor(data.cuda(), torch.arange(256, dtype=torch.uint8, device="cuda"), torch.tensor(0.37, device="cuda"),
                torch.Size([64, 64]), torch.float32)
for dt in (torch.float32, torch.bfloat16, torch.float16):
    a = dequantize_nvfp4(q, dtype=dt, backend="triton").float().flatten().cpu()
    b = dequantize_nvfp4_ref(q, dt).float().flatten().cpu()
    both_nan = torch.isnan(a) & torch.isnan(b)
    bad = ((a != b) | (torch.signbit(a) != torch.signbit(b))) & ~both_nan
    idx = bad.nonzero().flatten()
    print(dt, "mismatches", int(bad.sum()), "nan-mismatch", int((torch.isnan(a) != torch.isnan(b)).sum()))
    for i in idx[:6].tolist():
        print("  i", i, "byte", int(data[i // 2]), "nib", (int(data[i // 2]) >> (4 * (i % 2))) & 15, "scale", i // 16,
              "tri", repr(a[i].item()), "ref", repr(b[i].item()))
