"""Child process of test_cute_mod_cache.py's GPU test: library mods forward and backward on the GPU with the plan rule
mods_disk_cache on (FLASH_ATTN_CUTE_OVERRIDES / FLASH_ATTN_CUTE_CACHE set by the parent). ``write``: compiles and writes
the entries; ``load``: the compile functions raise, so every mod kernel must come from disk. Prints one JSON line:
{mod name: [max |out - ref|, max |dq - ref dq|]}, the references fp32 PyTorch autograd on the same inputs."""
import json
import sys

import torch

from flash_attn.cute import interface, kernels, mod_library as L, mods


def main(phase):
    if phase == "load":
        def refuse(*a, **k):
            raise RuntimeError("a mod kernel was compiled instead of loaded from disk")
        mods.compile_fwd_mods = refuse
        kernels.compile_bwd = refuse
    torch.manual_seed(0)
    B, S, H, D = 2, 320, 4, 64
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dout = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    cases = {"window": L.sliding_window(100, 0), "softcap": L.softcap(20.0),
             "alibi": L.alibi(torch.rand(H, device="cuda") * 0.1)}
    errors = {}
    for name, M in cases.items():
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = interface.flash_attn_func(qq, kk, vv, **M.kwargs())[0]
        out.backward(dout)
        qr, kr, vr = (t.float().requires_grad_() for t in (q, k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", qr, kr) * D ** -0.5
        ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(M.reference(scores), -1), vr)
        ref.backward(dout.float())
        errors[name] = [float((out.float() - ref).abs().max()), float((qq.grad.float() - qr.grad).abs().max())]
    print(json.dumps(errors))


if __name__ == "__main__":
    main(sys.argv[1])
