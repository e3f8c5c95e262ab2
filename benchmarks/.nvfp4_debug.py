import torch
from leantrain.ops.nvfp4 import NVFP4Tensor, dequantize_nvfp4, dequantize_nvfp4_ref
data = torch.arange(256, dtype=torch.uint8).repeat(8)
q = NVFP4Tensor(data.cuda(), torch.arange(256, dtype=torch.uint8, device="cuda"), torch.tensor(0.37, device="cuda"), torch.Size([64, 64]), torch.float32)
for dt in (torch.float32, torch.bfloat16, torch.float16):
    a = dequantize_nvfp4(q, dtype=dt, backend="triton").float().flatten()
    b = dequantize_nvfp4_ref(q, dt).float().flatten()
    nan = torch.isnan(a) | torch.isnan(b)
    bad = ((a != b) | (torch.signbit(a) != torch.signbit(b))) & ~(torch.isnan(a) & torch.isnan(b))
    idx = bad.nonzero().flatten()[:12]
    print(dt, "mismatches", int(bad.sum()), "nan-mismatch", int((torch.isnan(a) != torch.isnan(b)).sum()))
    for i in idx.tolist():
        print("  i", i, "byte", int(data[i // 2]), "scale", i // 16, "tri", a[i].item(), "ref", b[i].item())
