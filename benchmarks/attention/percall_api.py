"""Per-call time of the two attention APIs' common call on a tiny problem (b1 s128 h16 d128 bf16, non-causal):
flash_attn.flash_attn_func (the root API, on the dispatcher's backend) and flash_attn.cute.flash_attn_func, each
without gradients and with q, k, v requiring them (the forward of a training step). Per case: the fastest round's wall
time per call (the least disturbed by the host), calls back to back with one synchronize per round. One JSON line per run.

    python benchmarks/attention/percall_api.py [--rounds 30] [--calls 300] [--kvcache]
    PYTHONPATH=. python benchmarks/attention/percall_api.py --kvcache   # a checkout that is not installed

--kvcache adds a decoding call: flash_attn_with_kvcache (one query token, H 32, Hk 8, d 128, an 8k cache) through
the root API ("kvcache"), the Triton backend's fwd_kvcache alone ("kvcache backend": the front door's share is the
difference), the root flash_attn_func on the same q and cache ("root decode": what Hugging Face's flash_attention_2
calls per layer and token), SDPA on the same cache (enable_gqa), the FA4 API's paged decoding call on that cache in
64-row pages ("cute paged decode": flash_attn.cute.flash_attn_varlen_func with page_table and seqused_k, its value
checks' one sync included), and the Triton launchers' slow-path launch counts.

Standalone (imports only torch and flash_attn), so one checkout can time another: run it with that checkout's root
first on PYTHONPATH, alternating the two in separate processes, on one warm machine.
"""
import argparse
import json
import time

import torch


def _per_call(f, rounds, calls):
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return min(times)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--kvcache", action="store_true")
    a = p.parse_args(argv)
    import flash_attn
    import flash_attn.cute

    q, k, v = (torch.randn(1, 128, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    root, cute = flash_attn.flash_attn_func, flash_attn.cute.flash_attn_func
    res = {"flash_attn": flash_attn.__file__, "flash_attn.cute": flash_attn.cute.__file__}
    res["root"] = _per_call(lambda: root(q, k, v), a.rounds, a.calls)
    res["root, grad"] = _per_call(lambda: root(qg, kg, vg), a.rounds, a.calls)
    res["cute"] = _per_call(lambda: cute(q, k, v), a.rounds, a.calls)
    res["cute, grad"] = _per_call(lambda: cute(qg, kg, vg), a.rounds, a.calls)
    if a.kvcache:
        res.update(_kvcache(a.rounds, a.calls))
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}))


def _kvcache(rounds, calls):
    import torch.nn.functional as F

    import flash_attn
    import flash_attn.cute
    from flash_attn.call import describe
    from flash_attn.triton import backend as tb, kvcache as tkv

    B, Sk, H, Hk, D = 1, 8192, 32, 8, 128
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.randn(B, Sk, Hk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((B,), Sk, dtype=torch.int32, device="cuda")
    call = describe(q, vc, kvcache=True)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, kc, vc))
    launchers = {n: getattr(tkv, n) for n in dir(tkv) if n.startswith("_L_")}
    before = {n: lr.slow_launches for n, lr in launchers.items()}
    res = {"kvcache": _per_call(lambda: flash_attn.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens), rounds,
                                calls),
           "kvcache backend": _per_call(lambda: tb.fwd_kvcache(call, q, kc, vc, None, None, None, None, lens, None,
                                                               None, None, None, False, 0), rounds, calls),
           "root decode": _per_call(lambda: flash_attn.flash_attn_func(q, kc, vc), rounds, calls),
           "sdpa decode": _per_call(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True), rounds,
                                    calls)}
    # the same cache in 64-row pages, in order (page b * 128 + j is row b's j-th), through the FA4 API
    kp, vp = (t.reshape(B * Sk // 64, 64, Hk, D) for t in (kc, vc))
    table = torch.arange(B * Sk // 64, dtype=torch.int32, device="cuda").view(B, Sk // 64)
    cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    res["cute paged decode"] = _per_call(lambda: flash_attn.cute.flash_attn_varlen_func(
        q.view(B, H, D), kp, vp, cu_seqlens_q=cu_q, max_seqlen_q=1, seqused_k=lens, page_table=table,
        num_splits=0, pack_gqa=True), rounds, calls)
    res["kvcache slow launches"] = {n: lr.slow_launches - before[n] for n, lr in launchers.items()}
    return res


if __name__ == "__main__":
    main()
