import torch, os
from torch.profiler import profile, ProfilerActivity
from flash_attn.cute import flash_attn_func
torch.manual_seed(0)
for d in (64, 128):
    b, s, h = 16, 1024, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out, _ = flash_attn_func(q, k, v)
    g = torch.randn_like(out)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        torch.cuda.synchronize()
    print(os.environ.get("FLASH_ATTN_CUTE_OVERRIDES"), d)
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=6, max_name_column_width=60))
