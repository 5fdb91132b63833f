"""Per-call time of the tiny problem (b1 s128 h16 d128 bf16, non-causal) on the Triton path, from Python:
backend.fwd and flash_attn_func (300 calls back to back, median of 5 rounds), the GPU time (do_bench), and the
host cost of the warp-specialized plan, the TMA allocator hook and a scratch allocation. The per-call table of
record: benchmarks/results/h200/attention_triton.md.

    for v in "" off; do FLASH_ATTN_TRITON_OVERRIDES=fwd_variant=$v python -m benchmarks.attention.percall_triton; done

(flash_attn.triton reads FLASH_ATTN_TRITON_OVERRIDES once at import: one process per variant.)
"""
import time, torch
from benchmarks.common import per_call_us
import flash_attn
from flash_attn.triton import backend as tb
from flash_attn.triton import settings as ts
from triton.testing import do_bench
from flash_attn.testing import backend_fwd
q, k, v = (torch.randn(1, 128, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
kw = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=128, max_seqlen_k=128, block_table=None,
          softmax_scale=128 ** -0.5, causal=False, window_left=-1, window_right=-1, softcap=0.0,
          alibi_slopes=None, dropout_p=0.0, rng_state=None)
f = lambda: backend_fwd(tb, q, k, v, return_probs=False, **kw)
per_call = per_call_us  # 300 calls back to back, median of 5 rounds
print("variant", ts.overrides.get("fwd_variant"), "backend.fwd us", round(per_call(f), 1))
with flash_attn.use_backend("triton"):
    print("flash_attn_func us", round(per_call(lambda: flash_attn.flash_attn_func(q, k, v)), 1))
print("gpu time us (do_bench)", round(do_bench(f, warmup=20, rep=100) * 1e3, 1))
if tb._L_FWD_WS is not None:
    print("ws slow launches", tb._L_FWD_WS.slow_launches, "fwd slow", tb._L_FWD.slow_launches, "ws plans", len(tb._FWD_WS_PLANS))
    # pieces
    D = 128
    t0 = time.perf_counter()
    for _ in range(1000): tb._fwd_ws_plan(q, k, v, D, D, 128, 128, (False, False), 1 << 30, 1 << 30, 128 ** -0.5, None)
    print("plan us", round((time.perf_counter() - t0) * 1e3, 2))
    t0 = time.perf_counter()
    for _ in range(1000): tb._set_tma_allocator()
    print("set_allocator us", round((time.perf_counter() - t0) * 1e3, 2))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(1000): torch.empty(6144, dtype=torch.int8, device="cuda")
    print("scratch alloc us", round((time.perf_counter() - t0) * 1e3, 2))
qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
print("sdpa (default backend) us", round(per_call(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)), 1))
