"""Where the backward's gradient error sits: dQ, dK, dV of each backend against an fp64 reference on the same inputs,
with the largest errors located (batch, query row, head, column) and the error grouped by the row's place in the
kernel's tiles (row % 64, row % 128, and whether the row's key range ends inside the causal diagonal block).

For finding where a backward loses accuracy (a tile edge, the causal diagonal, one warpgroup's rows) before
changing its numerics.

    python -m benchmarks.tools.dq_error_map [--headdims 64,128] [--seqlen 1024] [--causal 1] [--backends cute,triton]

``--backends``: the dispatcher's backends to compare (``torch`` runs on a CPU too, as a check of the script); ``fa4``
is the released FA4's ``flash_attn.cute.flash_attn_func``, run with ``--peer-pythonpath P`` (the device bundle's
``$PEER_PYTHONPATH``) in a child process of this file with only P on its path, so that the project never shadows it;
the same seed gives it the same inputs. Prints a Markdown table per head dim; nothing is written.
"""
import argparse
import math
import os
import subprocess
import sys

import torch


def reference(q, k, v, dout, causal):
    """(dq, dk, dv) in fp64 of softmax(q k^T / sqrt(d)) v with bottom-right causal masking, per batch entry."""
    grads = [torch.empty(t.shape, dtype=torch.float64, device=t.device) for t in (q, k, v)]
    Sq, Sk, d = q.shape[1], k.shape[1], q.shape[-1]
    for b in range(q.shape[0]):
        qd, kd, vd = (t[b].double().transpose(0, 1).requires_grad_() for t in (q, k, v))  # (H, S, d)
        s = qd @ kd.transpose(-1, -2) / math.sqrt(d)
        if causal:
            keep = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device).tril(Sk - Sq)
            s = s.masked_fill(~keep, float("-inf"))
        o = torch.softmax(s, -1) @ vd
        o.backward(dout[b].double().transpose(0, 1))
        for g, t in zip(grads, (qd, kd, vd)):
            g[b] = t.grad.transpose(0, 1)
    return grads


def located(err):
    """(max, (b, row, head, col)) of an error tensor (B, S, H, D)."""
    flat = int(err.argmax())
    idx = []
    for n in reversed(err.shape):
        idx.append(flat % n)
        flat //= n
    return err.max().item(), tuple(reversed(idx))


def grouped(err, causal, Sk):
    """Max error by row group: row % 128 in [0, 64) or [64, 128), and (causal) rows whose diagonal falls in their last
    128-key block's first or second half."""
    rows = torch.arange(err.shape[1], device=err.device)
    per_row = err.amax(dim=(0, 2, 3))
    out = {"row%128<64": per_row[rows % 128 < 64].max().item(), "row%128>=64": per_row[rows % 128 >= 64].max().item()}
    if causal:
        diag = rows + Sk - err.shape[1]  # the last key each row sees
        out["diag%128<64"] = per_row[diag % 128 < 64].max().item()
        out["diag%128>=64"] = per_row[diag % 128 >= 64].max().item()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--headdims", default="64,128")
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--causal", type=int, default=1)
    p.add_argument("--backends", default="cute,triton")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer-pythonpath", default=None, help="PYTHONPATH of the released flash-attn-4 (backend fa4)")
    args = p.parse_args(argv)
    names = args.backends.split(",")
    if "fa4" in names and len(names) > 1:
        # the released FA4 in its own process (its flash_attn.cute and the project's cannot share one)
        if not args.peer_pythonpath:
            p.error("backend fa4 needs --peer-pythonpath")
        main([a for a in (argv if argv is not None else sys.argv[1:])] + ["--backends", ",".join(
            n for n in names if n != "fa4")])
        env = dict(os.environ, PYTHONPATH=args.peer_pythonpath)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--headdims", args.headdims, "--seqlen",
                        str(args.seqlen), "--batch", str(args.batch), "--heads", str(args.heads), "--causal",
                        str(args.causal), "--seed", str(args.seed), "--backends", "fa4"], env=env, check=True)
        return

    if names != ["fa4"]:
        import flash_attn

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    causal, S = bool(args.causal), args.seqlen
    for D in map(int, args.headdims.split(",")):
        g = torch.Generator(device=dev).manual_seed(args.seed)
        q, k, v, dout = (torch.randn(args.batch, S, args.heads, D, device=dev, generator=g).to(dt) for _ in range(4))
        ref = reference(q, k, v, dout, causal)
        print(f"\nd{D}, B {args.batch}, S {S}, H {args.heads}, causal {causal}, {dt}, {dev}\n")
        print("| backend | grad | max err | at (b, row, head, col) | mean err | by row group |")
        print("|---|---|---|---|---|---|")
        for name in names:
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            if name == "fa4":
                from flash_attn.cute import flash_attn_func as fa4_func

                out = fa4_func(qq, kk, vv, causal=causal)
                (out[0] if isinstance(out, tuple) else out).backward(dout)
            else:
                with flash_attn.use_backend(name):
                    flash_attn.flash_attn_func(qq, kk, vv, causal=causal).backward(dout)
                # the backend the dispatcher sends this backward to (a forced backend that cannot serve a backward
                # passes it on): the row is labelled with it
                from flash_attn import call as calls, dispatch

                served = dispatch.select(calls.describe(q, v, causal=causal, backward=True), forced=name).NAME
                name = name if served == name else f"{name} (backward: {served})"
            for label, got, want in zip("qkv", (qq.grad, kk.grad, vv.grad), ref):
                err = (got.double() - want).abs()
                top, where = located(err)
                groups = ", ".join(f"{n} {x:.4f}" for n, x in grouped(err, causal, S).items())
                print(f"| {name} | d{label} | {top:.5f} | {where} | {err.mean().item():.2e} | {groups} |")


if __name__ == "__main__":
    main()
