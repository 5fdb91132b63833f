"""flash_attn.cute's score_mod / mask_mod forward against PyTorch's FlexAttention (torch.compile(flex_attention)), both
given the same block mask (create_block_mask's BlockMask; ours through block_sparsity.from_block_mask) where the case
masks, and the native kernel where one computes the same thing. bf16, batch x seqlen = 16k tokens, H 16, D 128,
the forward (or --backward). do_bench medians in ms; TFLOP/s count the scores the
mask keeps (4 * B * H * D * kept pairs); the max difference between the two sides' outputs per case (bf16
rounding: ~1e-2). The block masks are built once per case, outside the timing, for both sides.

    python -m benchmarks.attention.bench_flex [--seqlens 1024,4096,8192] [--cases none,rel_bias,...] [--backward]

--backward: forward + backward (a fixed dO) of every case (the mask cases: ours with the BlockMask's forward and
backward lists; the score mods: their gradient through score_mod_bwd), TFLOP/s counting 3.5x the forward's work.

Cases: none (no mod: the plain kernels), rel_bias (score + 0.01 * (kv - q)), alibi (score - slope[h] * |q - kv|,
slopes an aux tensor), causal (a mask_mod), window (causal sliding window of 1024 keys), prefix (prefix-LM: causal,
plus the first 1024 keys for every query), document (a mask_mod on per-token document ids, an aux tensor of 4 to 16
documents per row), alibi_causal and softcap_causal (a score_mod with the causal mask_mod; softcap 30).
"""
import argparse

from benchmarks.common import ints as _ints

CASES = ("none", "rel_bias", "alibi", "causal", "window", "prefix", "document", "alibi_causal", "softcap_causal")
REL_SCALE = 0.01
WINDOW = 1024
PREFIX = 1024
SOFTCAP = 30.0


def _mods():
    """The CuTeDSL mods (FA4's convention; imported here so that --help needs no CuTeDSL)."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    @cute.jit
    def rel_bias(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return score + (kv_idx - q_idx).to(Float32) * cute.full_like(score, REL_SCALE)

    @cute.jit
    def alibi(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        slope = cute.full_like(score, 0.0) + Float32(aux_tensors[0][h_idx[0]])
        dist = (q_idx - kv_idx).to(Float32)
        zero = cute.full_like(dist, 0.0)
        return score - slope * cute.where(dist < zero, zero - dist, dist)

    @cute.jit
    def softcap(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        capped = cute.math.tanh(score * cute.full_like(score, 1.0 / SOFTCAP), fastmath=True)
        return capped * cute.full_like(score, SOFTCAP)

    @cute.jit
    def additive_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad  # rel_bias, alibi: score + a term that does not depend on it

    @cute.jit
    def softcap_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        t = cute.math.tanh(score * cute.full_like(score, 1.0 / SOFTCAP), fastmath=True)
        return grad * (cute.full_like(t, 1.0) - t * t)

    # mask_mods return a Boolean TensorSSA, as FA4's own definitions do (the released FA4 indexes the result)
    @cute.jit
    def causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return kv_idx <= q_idx

    @cute.jit
    def window(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < cute.full_like(q_idx, WINDOW))

    @cute.jit
    def prefix(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return (kv_idx <= q_idx) | (kv_idx < cute.full_like(kv_idx, PREFIX))

    @cute.jit
    def document(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        docs = aux_tensors[0]
        q_doc = cute.make_rmem_tensor(1, Int32)
        q_doc[0] = docs[b_idx[0], q_idx[0]]
        k_doc = cute.make_rmem_tensor(1, Int32)
        k_doc[0] = docs[b_idx[0], kv_idx[0]]
        return q_doc.load() == k_doc.load()

    return {"rel_bias": (rel_bias, additive_bwd, None), "alibi": (alibi, additive_bwd, None),
            "causal": (None, None, causal), "window": (None, None, window), "prefix": (None, None, prefix),
            "document": (None, None, document), "alibi_causal": (alibi, additive_bwd, causal),
            "softcap_causal": (softcap, softcap_bwd, causal)}


def _flex_fns(slopes, docs):
    """FlexAttention's (score_mod, mask_mod) of each case (None: absent)."""
    import torch

    causal = lambda b, h, qi, ki: ki <= qi  # noqa: E731
    alibi = lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki).abs()  # noqa: E731
    return {
        "rel_bias": (lambda s, b, h, qi, ki: s + (ki - qi) * REL_SCALE, None),
        "alibi": (alibi, None),
        "causal": (None, causal),
        "window": (None, lambda b, h, qi, ki: (ki <= qi) & (qi - ki < WINDOW)),
        "prefix": (None, lambda b, h, qi, ki: (ki <= qi) | (ki < PREFIX)),
        "document": (None, lambda b, h, qi, ki: docs[b, qi] == docs[b, ki]),
        "alibi_causal": (alibi, causal),
        "softcap_causal": (lambda s, b, h, qi, ki: SOFTCAP * torch.tanh(s / SOFTCAP), causal),
    }


def mods_call(flash_attn_func, compute_block_sparsity, case, B, S, H, D):
    """A forward call of ``case`` (one of CASES but "none") on one FA4-API implementation: its flash_attn_func and
    compute_block_sparsity (ours, or the released FA4's: vs_fa4.py --mods runs each in its own process), bf16 inputs
    of (B, S, H, D) from a fixed seed, the case's mods (the same CuTeDSL functions on both sides), its aux tensors and,
    with a mask_mod, block sparsity of 128 x 128 tiles from compute_block_sparsity (built outside the timing). Returns
    (fn, kept share of (query, key) pairs)."""
    import torch

    g = torch.Generator().manual_seed(S)
    q, k, v = (torch.randn(B, S, H, D, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    slopes = (torch.rand(H, generator=g) * 0.1).cuda()
    n_docs = torch.randint(4, 17, (B,), generator=g)
    docs = torch.stack([torch.sort(torch.randint(0, int(n), (S,), generator=g)).values for n in n_docs])
    docs = docs.to(device="cuda", dtype=torch.int32)
    score_mod, score_mod_bwd, mask_mod = _mods()[case]
    aux = [slopes] if "alibi" in case else [docs] if case == "document" else None
    sparse = None
    if mask_mod is not None:
        sparse = compute_block_sparsity(128, 128, B, H, S, S, mask_mod, aux if case == "document" else None, "cuda")
    kept = _kept(_flex_fns(slopes, docs)[case][1], B, S, "cuda")

    def fn():
        return flash_attn_func(q, k, v, score_mod=score_mod, mask_mod=mask_mod, aux_tensors=aux,
                               block_sparse_tensors=sparse)[0]
    return fn, kept


def _with_backward(fn, dout):
    """fn's forward and a backward of dout through it (None for None)."""
    if fn is None:
        return None

    def step():
        fn().backward(dout)
    return step


def _kept(mask_fn, B, S, device):
    """The share of (query, key) pairs mask_fn keeps, over the batch (1.0 without a mask); rows in chunks."""
    import torch

    if mask_fn is None:
        return 1.0
    kept = 0
    k = torch.arange(S, device=device)[None, :]
    for b in range(B):
        for r0 in range(0, S, 2048):
            q = torch.arange(r0, min(S, r0 + 2048), device=device)[:, None]
            kept += int(mask_fn(torch.tensor(b, device=device), 0, q, k).sum())
    return kept / (B * S * S)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=_ints, default=[1024, 4096, 8192])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--backward", action="store_true", help="time forward + backward")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; cases: {', '.join(CASES)}")

    import torch
    import triton.testing
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from benchmarks import common
    from flash_attn import cute
    from flash_attn.cute import block_sparsity

    if not torch.cuda.is_available():
        raise SystemExit("bench_flex needs a CUDA GPU")
    mods = _mods()
    H, D = args.heads, args.headdim
    lines = common.header("benchmarks.attention.bench_flex", argv)
    lines += ["", "| seqlen | case | kept | ours ms (TFLOP/s) | FlexAttention ms (TFLOP/s) | flex / ours (time) | "
              "max diff | native ms (ours / native) |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for S in args.seqlens:
        B = max(1, 16384 // S)
        g = torch.Generator(device="cuda").manual_seed(S)
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # FlexAttention's (B, H, S, D)
        dout = torch.randn_like(q)
        dout_f = dout.transpose(1, 2).contiguous()
        slopes = torch.rand(H, device="cuda", generator=g) * 0.1
        n_docs = torch.randint(4, 17, (B,), generator=torch.Generator().manual_seed(S))
        docs = torch.stack([torch.sort(torch.randint(0, int(n), (S,), device="cuda")).values for n in n_docs])
        docs = docs.to(torch.int32)
        flex_fns = _flex_fns(slopes, docs)
        natives = {"none": dict(), "causal": dict(causal=True), "window": dict(window_size=(WINDOW - 1, 0)),
                   "softcap_causal": dict(causal=True, softcap=SOFTCAP)}
        for case in cases:
            # a fresh compile per case: the cases' graphs would otherwise pile up against dynamo's recompile limit,
            # past which flex_attention runs unfused (materialising the scores) and the timing means nothing
            torch._dynamo.reset()
            flex = torch.compile(flex_attention, dynamic=False)
            aux = [slopes] if "alibi" in case else [docs] if case == "document" else None
            flex_mod, flex_mask = flex_fns.get(case, (None, None))
            kept = _kept(flex_mask, B, S, q.device)
            flops = 4 * B * S * S * H * D * kept * (3.5 if args.backward else 1.0)
            if case == "none":
                ours = lambda: cute.flash_attn_func(q, k, v)[0]  # noqa: E731
                theirs = lambda: flex(qf, kf, vf)  # noqa: E731
            else:
                score_mod, score_mod_bwd, mask_mod = mods[case]
                block_mask = sparse = None
                if flex_mask is not None:
                    block_mask = create_block_mask(flex_mask, B, None, S, S, device="cuda")
                    sparse = block_sparsity.from_block_mask(block_mask)
                sparse_bwd = None if block_mask is None else block_sparsity.from_block_mask_bwd(block_mask)
                ours = lambda sm=score_mod, smb=score_mod_bwd, mm=mask_mod, a=aux, t=sparse, tb=sparse_bwd: (  # noqa
                    cute.flash_attn_func(q, k, v, score_mod=sm, score_mod_bwd=smb, mask_mod=mm, aux_tensors=a,
                                         block_sparse_tensors=t,
                                         block_sparse_tensors_bwd=tb if q.requires_grad else None)[0])
                theirs = lambda m=flex_mod, bm=block_mask: flex(qf, kf, vf, score_mod=m, block_mask=bm)  # noqa: E731
            diff = (ours().float() - theirs().transpose(1, 2).float()).abs().max().item()
            native_fn = None
            if case in natives:
                native_fn = lambda kw=natives[case]: cute.flash_attn_func(q, k, v, **kw)[0]  # noqa: E731
            if args.backward:
                for t in (q, k, v, qf, kf, vf):
                    t.requires_grad_(True)
                ours, theirs, native_fn = (_with_backward(f, d) for f, d in ((ours, dout), (theirs, dout_f),
                                                                             (native_fn, dout)))
            t_ours = triton.testing.do_bench(ours, warmup=args.warmup, rep=args.rep)
            t_flex = triton.testing.do_bench(theirs, warmup=args.warmup, rep=args.rep)
            for t in (q, k, v, qf, kf, vf):
                t.requires_grad_(False)
                t.grad = None
            native = ""
            if native_fn is not None:
                if args.backward:
                    for t in (q, k, v):
                        t.requires_grad_(True)
                t_native = triton.testing.do_bench(native_fn, warmup=args.warmup, rep=args.rep)
                for t in (q, k, v):
                    t.requires_grad_(False)
                    t.grad = None
                native = f"{t_native:.3f} ({t_ours / t_native:.2f}x)"
            line = (f"| {S} | {case} | {kept:.3f} | {t_ours:.3f} ({flops / t_ours / 1e9:.0f}) | {t_flex:.3f} "
                    f"({flops / t_flex / 1e9:.0f}) | {t_flex / t_ours:.2f}x | {diff:.3g} | {native} |")
            lines.append(line)
            print(line, flush=True)


if __name__ == "__main__":
    main()
