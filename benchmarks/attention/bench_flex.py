"""flash_attn.cute's score_mod / mask_mod forward against PyTorch's FlexAttention (torch.compile(flex_attention), with
a block mask from create_block_mask where the case masks), and each side's plain attention for reference. bf16,
batch x seqlen = 16k tokens, H 16, D 128, forward only (the mods' backward is not implemented here yet). do_bench
medians in ms and TFLOP/s counted as dense attention (4 * B * S^2 * H * D, half for the causal cases); the max
difference between the two sides' outputs per case (bf16 rounding: ~1e-2).

    python -m benchmarks.attention.bench_flex [--seqlens 1024,4096,8192] [--cases none,rel_bias,alibi,causal,document]

Cases: none (no mod: the plain kernels), rel_bias (score + 0.01 * (kv - q)), alibi (score - slope[h] * |q - kv|,
slopes an aux tensor), causal (a mask_mod; FlexAttention skips the masked blocks through its block mask, this
package has no block sparsity yet and evaluates the mask on every tile; "causal=True" beside it is the native
causal kernel), document (a mask_mod on per-token document ids, an aux tensor of 4 to 16 documents per row).
"""
import argparse

from benchmarks.common import ints as _ints

CASES = ("none", "rel_bias", "alibi", "causal", "document")
REL_SCALE = 0.01


def _mods():
    """The CuTeDSL mods (FA4's convention; imported here so that --help needs no CuTeDSL)."""
    import cutlass.cute as cute
    from cutlass import Float32

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
    def causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return kv_idx[0] <= q_idx[0] + seqlen_info.seqlen_k - seqlen_info.seqlen_q

    @cute.jit
    def document(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        docs = aux_tensors[0]
        return docs[b_idx[0], q_idx[0]] == docs[b_idx[0], kv_idx[0]]

    return {"rel_bias": (rel_bias, None), "alibi": (alibi, None), "causal": (None, causal),
            "document": (None, document)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=_ints, default=[1024, 4096, 8192])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--headdim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
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

    if not torch.cuda.is_available():
        raise SystemExit("bench_flex needs a CUDA GPU")
    mods = _mods()
    H, D = args.heads, args.headdim
    lines = common.header("benchmarks.attention.bench_flex", argv)
    lines += ["", "| seqlen | case | ours ms (TFLOP/s) | FlexAttention ms (TFLOP/s) | flex / ours (time) | max diff |",
              "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for S in args.seqlens:
        B = max(1, 16384 // S)
        g = torch.Generator(device="cuda").manual_seed(S)
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # FlexAttention's (B, H, S, D)
        slopes = torch.rand(H, device="cuda", generator=g) * 0.1
        n_docs = torch.randint(4, 17, (B,), generator=torch.Generator().manual_seed(S))
        docs = torch.stack([torch.sort(torch.randint(0, int(n), (S,), device="cuda")).values for n in n_docs])
        docs = docs.to(torch.int32)
        for case in cases:
            # a fresh compile per case: the cases' graphs would otherwise pile up against dynamo's recompile limit,
            # past which flex_attention runs unfused (materialising the scores) and the timing means nothing
            torch._dynamo.reset()
            flex = torch.compile(flex_attention, dynamic=False)
            flops = 4 * B * S * S * H * D // (2 if case == "causal" else 1)
            aux = [slopes] if case == "alibi" else [docs] if case == "document" else None
            if case == "none":
                ours = lambda: cute.flash_attn_func(q, k, v)[0]  # noqa: E731
                theirs = lambda: flex(qf, kf, vf)  # noqa: E731
            else:
                score_mod, mask_mod = mods[case]
                ours = lambda sm=score_mod, mm=mask_mod, a=aux: cute.flash_attn_func(  # noqa: E731
                    q, k, v, score_mod=sm, mask_mod=mm, aux_tensors=a)[0]
                block_mask, flex_mod = None, None
                if case == "rel_bias":
                    flex_mod = lambda s, b, h, qi, ki: s + (ki - qi) * REL_SCALE  # noqa: E731
                elif case == "alibi":
                    flex_mod = lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki).abs()  # noqa: E731
                else:
                    fn = ((lambda b, h, qi, ki: ki <= qi) if case == "causal"
                          else (lambda b, h, qi, ki: docs[b, qi] == docs[b, ki]))
                    block_mask = create_block_mask(fn, B, None, S, S, device="cuda")
                theirs = lambda m=flex_mod, bm=block_mask: flex(qf, kf, vf, score_mod=m, block_mask=bm)  # noqa: E731
            diff = (ours().float() - theirs().transpose(1, 2).float()).abs().max().item()
            t_ours = triton.testing.do_bench(ours, warmup=args.warmup, rep=args.rep)
            t_flex = triton.testing.do_bench(theirs, warmup=args.warmup, rep=args.rep)
            line = (f"| {S} | {case} | {t_ours:.3f} ({flops / t_ours / 1e9:.0f}) | {t_flex:.3f} "
                    f"({flops / t_flex / 1e9:.0f}) | {t_flex / t_ours:.2f}x | {diff:.3g} |")
            if case == "causal":
                t_native = triton.testing.do_bench(lambda: cute.flash_attn_func(q, k, v, causal=True)[0],
                                                   warmup=args.warmup, rep=args.rep)
                line += f" causal=True: {t_native:.3f} ms"
            lines.append(line)
            print(line, flush=True)


if __name__ == "__main__":
    main()
