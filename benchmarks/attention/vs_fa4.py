"""The cute forward against the released FA4, cell by cell in alternating rounds: one worker process per side
(both import ``flash_attn.cute``, so they cannot share a process), kept alive over the whole grid; for each cell
both build the same inputs and compile, then every round times each side with do_bench (median), the order
rotated per round; a side's figure is the median of its rounds. bench_attention.py times all our cells first
and the peer's after, minutes apart: two such grids move single cells by up to 10%, FA4's as much as
ours (benchmarks/results/h200/attention.md). Here the two sides of a cell are timed seconds apart, and
``--control`` adds a second worker of ours, whose ratio to the first is the noise floor of the comparison.

    python -m benchmarks.attention.vs_fa4 --peer-pythonpath "$PEER_PYTHONPATH" [--headdims 64,128,256]
        [--seqlens 1024,2048,4096,8192,16384] [--causal 0,1] [--rounds 5] [--control] [--out DIR]

bf16, batch x seqlen = --tokens, heads = --hidden / head dim (the standard grid); forward TFLOP/s = 4*B*S^2*H*D
(half if causal) / time. Writes vs_fa4.md under --out (default benchmarks/results/h200).

    python -m benchmarks.attention.vs_fa4 --peer-pythonpath "$PEER_PYTHONPATH" --decode [--shapes B:Sq:Sk:H:Hk:D,...]
        [--call num_splits=0,pack_gqa=None]

--decode: decoding shapes instead (ab_cute_decode.py's defaults: few queries, long keys, GQA), both sides called
with --call's options (FA4's num_splits / pack_gqa; a side that refuses them shows its error); microseconds per
call and the K / V read rate. Writes vs_fa4_decode.md.

    python -m benchmarks.attention.vs_fa4 --peer-pythonpath "$PEER_PYTHONPATH" --mods [CASES] [--seqlens 4096,16384]
        [--headdims 128]

--mods: FA4's score_mod / mask_mod forward with the same CuTeDSL mods on both sides (bench_flex.mods_call: issue
30's cases, default causal,window,prefix,document,alibi_causal,softcap_causal), block sparsity from each side's
own compute_block_sparsity (128 x 128 tiles); TFLOP/s on the kept pairs. Writes vs_fa4_mods.md.

    python -m benchmarks.attention.vs_fa4 --peer-pythonpath "$PEER_PYTHONPATH" --bwd [--control]

--bwd: the backward on the standard grid instead: each side's torch.autograd.grad of its flash_attn_func's out
(q, k and v requiring gradients, one fixed dout), timed in the same alternating rounds; backward TFLOP/s = 2.5 x the
forward's FLOPs / time. Writes vs_fa4_bwd.md.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys

from benchmarks import common
from benchmarks.attention.ab_cute_bwd import round_order as _rotated

MODULE = "benchmarks.attention.vs_fa4"


def round_order(sides, r):
    """The sides' order in round r: rotated by r, so each side is timed first equally often (the A/B harness's
    order, ab_cute_bwd.round_order)."""
    return [side for _, side in _rotated(sides, r)]


# ----------------------------------------------------------------------------------------------------
# Worker: one side, driven by JSON lines on stdin; one JSON line back per request


def worker(name):
    stub = dict(item.split("=") for item in os.environ.get("VS_FA4_STUB", "").split(",") if item)
    log = os.environ.get("VS_FA4_STUB_LOG")
    fn = None
    if not stub:
        import torch
        from triton.testing import do_bench

        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.compute_block_sparsity import compute_block_sparsity
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "quit":
                break
            if stub:  # CPU tests of the driver: fixed times, the order of the requests logged
                if req["op"] == "time" and log:
                    with open(log, "a") as f:
                        f.write(name + "\n")
                reply = ({"ms": float(stub[name])} if req["op"] == "time" else
                         {"kernels": {f"{name}_main": 800 * float(stub[name]), "prep": 200 * float(stub[name])}}
                         if req["op"] == "kernels" else
                         {"device": "stub", "versions": {}, **({"kept": 0.5} if "mods" in req else {})})
            elif req["op"] == "setup" and "mods" in req:
                from benchmarks.attention.bench_flex import mods_call

                fn = None
                torch.cuda.empty_cache()
                fn, kept = mods_call(flash_attn_func, compute_block_sparsity, req["mods"], req["b"], req["s"],
                                     req["h"], req["d"])
                fn()  # compile the kernel outside the timing
                torch.cuda.synchronize()
                reply = {"device": torch.cuda.get_device_name(), "versions": _versions(), "kept": kept}
            elif req["op"] == "setup":
                fn = None
                torch.cuda.empty_cache()
                g = torch.Generator().manual_seed(0)
                b, h, d = req["b"], req["h"], req["d"]
                sq, sk, hk = req["s"], req.get("sk", req["s"]), req.get("hk", h)
                q = torch.randn(b, sq, h, d, generator=g).to("cuda", torch.bfloat16)
                k, v = (torch.randn(b, sk, hk, d, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
                causal, kw = bool(req["causal"]), req.get("kw", {})
                fn = lambda: flash_attn_func(q, k, v, causal=causal, **kw)  # noqa: E731
                if req.get("bwd"):  # the backward of one forward, its graph kept
                    q, k, v = (t.requires_grad_() for t in (q, k, v))
                    out = flash_attn_func(q, k, v, causal=causal, **kw)
                    out = out[0] if isinstance(out, tuple) else out
                    dout = torch.randn(out.shape, generator=g).to("cuda", out.dtype)
                    fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
                fn()  # compile or load the kernels outside the timing
                torch.cuda.synchronize()
                reply = {"device": torch.cuda.get_device_name(), "versions": _versions()}
            elif req["op"] == "time":
                reply = {"ms": do_bench(fn, warmup=req["warmup"], rep=req["rep"], return_mode="median")}
            elif req["op"] == "kernels":  # each kernel's device us per call (the profiler's; --kernels)
                reply = {"kernels": common.kernel_us(fn, reps=10)}
            else:
                reply = {"error": f"unknown op {req['op']!r}"}
        except Exception as e:  # reported to the driver: that cell of this side is missing
            reply = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(json.dumps(reply), flush=True)


def _versions():
    from importlib import metadata

    import torch

    out = {"torch": torch.__version__}
    for dist in ("nvidia-cutlass-dsl", "flash-attn-4", "apache-tvm-ffi"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


# ----------------------------------------------------------------------------------------------------
# Driver


class Side:
    def __init__(self, name, pythonpath, cwd, overrides=None):
        env = dict(os.environ)
        env["PYTHONPATH"] = pythonpath
        if overrides is not None:  # (--control-overrides: the control worker as the other arm of an A/B)
            env["FLASH_ATTN_CUTE_OVERRIDES"] = overrides
        self.name = name
        self.proc = subprocess.Popen([sys.executable, "-m", MODULE, "--_worker", name], env=env, cwd=cwd,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            return {"error": f"worker {self.name} exited (rc {self.proc.poll()})"}
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                pass
        self.proc.wait(timeout=60)


def _setup(cell, kw, bwd=False):
    """The setup request of a cell: (d, s, causal, b, h) of the standard grid (bwd: its backward), (b, sq, sk, h, hk,
    d, causal) of a decoding shape (with the call's options kw), or (case, d, s, b, h) of --mods."""
    if isinstance(cell[0], str):
        case, d, s, b, h = cell
        return dict(mods=case, d=d, s=s, b=b, h=h), f"{case} d{d} s{s}"
    if len(cell) == 5:
        d, s, causal, b, h = cell
        return (dict(d=d, s=s, causal=int(causal), b=b, h=h, **({"bwd": 1} if bwd else {})),
                f"d{d} s{s} causal={int(causal)}{' bwd' if bwd else ''}")
    b, sq, sk, h, hk, d, causal = cell
    return (dict(d=d, s=sq, sk=sk, causal=int(causal), b=b, h=h, hk=hk, kw=kw),
            f"{b}:{sq}:{sk}:{h}:{hk}:{d} causal={int(causal)}")


def compare(sides, cells, rounds, warmup, rep, log=print, kw=None, bwd=False, kernels=False):
    """{cell: {side: median ms, or an error string}} over ``cells`` = [(d, s, causal, b, h)] (their backward with bwd;
    or decoding shapes, see _setup, called with the options kw), plus the device and versions the first side
    reported (with kernels, info["kernels"][cell][side]: {kernel: device us per call}, logged too)."""
    results, info = {}, {}
    for cell in cells:
        req, label = _setup(cell, kw or {}, bwd)
        res, alive = {}, []
        for side in sides:
            rep_ = side.ask(op="setup", **req)
            if "error" in rep_:
                res[side.name] = rep_["error"]
            else:
                info.setdefault(side.name, rep_)
                if "kept" in rep_:  # (--mods: the share of pairs the case keeps, for its TFLOP/s)
                    info.setdefault("kept", {})[cell] = rep_["kept"]
                alive.append(side)
        times = {side.name: [] for side in alive}
        for r in range(rounds):
            for side in round_order(alive, r):
                if side.name not in times:
                    continue
                got = side.ask(op="time", warmup=warmup, rep=rep)
                if "error" in got:
                    res[side.name] = got["error"]
                    del times[side.name]
                else:
                    times[side.name].append(got["ms"])
        for name, ts in times.items():
            res[name] = statistics.median(ts)
        results[cell] = res
        log(f"{label}: " + ", ".join(
            f"{n} {v:.3f} ms" if isinstance(v, float) else f"{n} ERROR {v}" for n, v in res.items()))
        for side in alive if kernels else ():
            got = side.ask(op="kernels")
            if "kernels" in got:
                info.setdefault("kernels", {}).setdefault(cell, {})[side.name] = got["kernels"]
                log(f"  {side.name} kernels (us): " + "; ".join(f"{k[:80]} {t:.1f}" for k, t in got["kernels"].items()))
    return results, info


def _header(title, info, names, command):
    """The report's first lines: title, GPU and both sides' versions, date, command."""
    first = info.get(names[0], {})
    return [f"# {title}, interleaved per cell (benchmarks/attention/vs_fa4.py)", "",
            f"- GPU: {first.get('device', '?')}; ours: " + ", ".join(f"{k} {v}" for k, v in first.get(
                "versions", {}).items()),
            "- fa4: " + ", ".join(f"{k} {v}" for k, v in info.get("fa4", {}).get("versions", {}).items()),
            f"- date: {common.date()}",
            f"- command: `{command}`"]


def report(results, info, names, args, command):
    """Markdown: TFLOP/s per side, ours / fa4 (and the control's ratio to ours), and the summary line (--bwd: the
    backward's, 2.5 x the forward's FLOPs)."""
    what, factor = ("backward", 2.5) if args.bwd else ("forward", 1.0)
    lines = _header(f"Cute {what} vs the released FA4", info, names, command) + [
             f"- bf16, batch x seqlen = {args.tokens} tokens, hidden {args.hidden}; {what} TFLOP/s"
             + (" (2.5 x the forward's FLOPs; torch.autograd.grad of each side's flash_attn_func)" if args.bwd else "")
             + " from the median of "
             f"{args.rounds} rounds (each a do_bench median, warmup {args.warmup} ms, rep {args.rep} ms), the sides' "
             "order rotated per round", "",
             "| head dim | causal | seqlen | " + " | ".join(names) + " | ours / fa4 |"
             + (" ours2 / ours |" if "ours2" in names else ""),
             "|---|---|---|" + "---|" * (len(names) + 1 + ("ours2" in names))]
    ratios, controls = [], []
    for (d, s, causal, b, h), res in results.items():
        flops = factor * 4 * b * s * s * h * d / (2 if causal else 1)
        tf = {n: flops / res[n] * 1e-9 if isinstance(res.get(n), float) else None for n in names}
        cells = [f"{tf[n]:.0f}" if tf[n] else "error" for n in names]
        ratio = tf["ours"] / tf["fa4"] if tf.get("ours") and tf.get("fa4") else None
        row = f"| {d} | {causal} | {s} | " + " | ".join(cells) + (f" | {ratio:.3f} |" if ratio else " | - |")
        if ratio:
            ratios.append(ratio)
        if "ours2" in names:
            c = tf["ours2"] / tf["ours"] if tf.get("ours2") and tf.get("ours") else None
            row += f" {c:.3f} |" if c else " - |"
            if c:
                controls.append(c)
        lines.append(row)
    lines.append("")
    if ratios:
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        lines.append(f"ours / fa4: geometric mean {geo:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}; "
                     f"{sum(r >= 1.0 for r in ratios)} of {len(ratios)} cells >= 1.0")
    if controls:
        what = (f"FLASH_ATTN_CUTE_OVERRIDES={args.control_overrides}" if args.control_overrides is not None
                else "the same settings")
        lines.append(f"control (a second worker of ours, {what}): ratio to ours {min(controls):.3f}..{max(controls):.3f}, "
                     f"geometric mean {math.exp(sum(map(math.log, controls)) / len(controls)):.3f}")
    lines += _kernel_lines(info)
    return "\n".join(lines) + "\n"


def _kernel_lines(info):
    """--kernels: each cell's kernels per side, device us per call (the profiler's, 10 calls after the timing)."""
    table = info.get("kernels")
    if not table:
        return []
    lines = ["", "Kernels per call (device us, torch.profiler over 10 calls):", ""]
    for cell, sides in table.items():
        label = _setup(cell, {})[1]
        for side, rows in sides.items():
            total = sum(rows.values())
            lines.append(f"- {label}, {side} ({total:.0f} us): " + "; ".join(f"`{k[:80]}` {t:.1f}"
                                                                          for k, t in rows.items()))
    return lines


def report_decode(results, info, names, args, command, kw):
    """Markdown for --decode: microseconds per call per side, fa4's time / ours (> 1: ours faster), the K / V read
    rate of ours, and the summary line."""
    from benchmarks.attention.ab_cute_decode import kv_bytes

    lines = _header("Cute forward vs the released FA4 on decoding shapes", info, names, command) + [
             f"- bf16; both sides called with {kw or 'their defaults'}; us per call from the median of {args.rounds} "
             f"rounds (each a do_bench median, warmup {args.warmup} ms, rep {args.rep} ms), the order rotated", "",
             "| B:Sq:Sk:H:Hk:D | causal | " + " | ".join(f"{n} us" for n in names) + " | fa4 / ours | ours GB/s |",
             "|---|---|" + "---|" * (len(names) + 2)]
    ratios = []
    for (b, sq, sk, h, hk, d, causal), res in results.items():
        us = {n: res[n] * 1e3 if isinstance(res.get(n), float) else None for n in names}
        ratio = us["fa4"] / us["ours"] if us.get("ours") and us.get("fa4") else None
        if ratio:
            ratios.append(ratio)
        rate = f"{kv_bytes(b, sk, hk, d) / (us['ours'] * 1e3):.0f}" if us.get("ours") else "-"
        lines.append(f"| {b}:{sq}:{sk}:{h}:{hk}:{d} | {causal} | "
                     + " | ".join(f"{us[n]:.1f}" if us[n] else "error" for n in names)
                     + (f" | {ratio:.3f}" if ratio else " | -") + f" | {rate} |")
    lines.append("")
    if ratios:
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        lines.append(f"fa4 / ours (time): geometric mean {geo:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}; "
                     f"{sum(r >= 1.0 for r in ratios)} of {len(ratios)} cells with ours at least as fast")
    errors = sorted({f"{n}: {v}" for res in results.values() for n, v in res.items() if isinstance(v, str)})
    lines += [f"- error: {e}" for e in errors]
    return "\n".join(lines) + "\n"


def report_mods(results, info, names, args, command):
    """Markdown for --mods: TFLOP/s on the kept pairs per side, ours / fa4, the summary line and the errors (a case a
    side refuses)."""
    lines = _header("Cute forward with score_mod / mask_mod vs the released FA4", info, names, command) + [
             f"- bf16, batch x seqlen = {args.tokens} tokens, hidden {args.hidden}; the same CuTeDSL mods on both sides "
             "(bench_flex.mods_call), block sparsity from each side's compute_block_sparsity (128 x 128); TFLOP/s on "
             f"the kept pairs from the median of {args.rounds} rounds (each a do_bench median, warmup {args.warmup} ms,"
             f" rep {args.rep} ms), the order rotated", "",
             "| case | head dim | seqlen | kept | " + " | ".join(names) + " | ours / fa4 |",
             "|---|---|---|---|" + "---|" * (len(names) + 1)]
    ratios = []
    kept_of = info.get("kept", {})
    for cell, res in results.items():
        case, d, s, b, h = cell
        kept = kept_of.get(cell)
        flops = 4 * b * s * s * h * d * (kept or 0.0)
        tf = {n: flops / res[n] * 1e-9 if isinstance(res.get(n), float) and kept else None for n in names}
        ratio = tf["ours"] / tf["fa4"] if tf.get("ours") and tf.get("fa4") else None
        if ratio:
            ratios.append(ratio)
        lines.append(f"| {case} | {d} | {s} | " + (f"{kept:.3f}" if kept else "-") + " | "
                     + " | ".join(f"{tf[n]:.0f}" if tf[n] else "error" for n in names)
                     + (f" | {ratio:.3f} |" if ratio else " | - |"))
    lines.append("")
    if ratios:
        geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
        lines.append(f"ours / fa4: geometric mean {geo:.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}; "
                     f"{sum(r >= 1.0 for r in ratios)} of {len(ratios)} cells >= 1.0")
    errors = sorted({f"{n}: {v}" for res in results.values() for n, v in res.items() if isinstance(v, str)})
    lines += [f"- error: {e}" for e in errors]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer-pythonpath", default=None, help="PYTHONPATH of the released flash-attn-4 (required)")
    p.add_argument("--headdims", default="64,128,256")
    p.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=40)
    p.add_argument("--control", action="store_true", help="a second worker of ours (the noise floor)")
    p.add_argument("--control-overrides", default=None,
                   help="FLASH_ATTN_CUTE_OVERRIDES of the control worker (implies --control): its ratio to ours is "
                        "then an A/B of those overrides, measured in the same alternating rounds")
    p.add_argument("--decode", action="store_true", help="decoding shapes (--shapes) instead of the standard grid")
    p.add_argument("--shapes", default=None, help="--decode: comma-separated B:Sq:Sk:H:Hk:D (ab_cute_decode's)")
    p.add_argument("--call", default="", help="--decode: both sides' options, e.g. num_splits=0,pack_gqa=None")
    p.add_argument("--mods", nargs="?", const="causal,window,prefix,document,alibi_causal,softcap_causal",
                   default=None, help="score_mod / mask_mod cases (bench_flex's) instead of the standard grid")
    p.add_argument("--bwd", action="store_true", help="the standard grid's backward instead of its forward")
    p.add_argument("--kernels", action="store_true",
                   help="after each cell's timing, each side's kernels and their device us per call (profiler)")
    p.add_argument("--out", default=common.results_dir())
    p.add_argument("--_worker", dest="worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if not args.peer_pythonpath:
        p.error("--peer-pythonpath is required (the released flash-attn-4's PYTHONPATH)")
    if args.bwd and (args.mods or args.decode):
        p.error("--bwd times the standard grid's backward: not with --mods or --decode")
    kw = None
    if args.mods:
        from benchmarks.attention.bench_flex import CASES

        bad = [c for c in args.mods.split(",") if c not in CASES or c == "none"]
        if bad:
            p.error(f"--mods: unknown cases {bad}; cases: {', '.join(c for c in CASES if c != 'none')}")
        cells = [(case, d, s, max(1, args.tokens // s), args.hidden // d) for case in args.mods.split(",")
                 for d in map(int, args.headdims.split(",")) for s in map(int, args.seqlens.split(","))]
    elif args.decode:
        from benchmarks.attention.ab_cute_decode import DEFAULT_SHAPES, parse_shapes, parse_variants

        kw = parse_variants(f"call:{args.call}")[0][0][1]
        cells = [(*shape, c == "1") for c in args.causal.split(",")
                 for shape in parse_shapes(args.shapes or DEFAULT_SHAPES)]
    else:
        cells = [(d, s, c == "1", max(1, args.tokens // s), args.hidden // d)
                 for d in map(int, args.headdims.split(",")) for c in args.causal.split(",")
                 for s in map(int, args.seqlens.split(","))]
    ours_path = os.pathsep.join([common.ROOT] + [x for x in [os.environ.get("PYTHONPATH")] if x])
    # the peer's worker runs where no flash_attn package is (its own comes from --peer-pythonpath)
    specs = [("ours", ours_path, common.ROOT), ("fa4", args.peer_pythonpath, common.peer_cwd())]
    if args.control or args.control_overrides is not None:
        specs.append(("ours2", ours_path, common.ROOT, args.control_overrides))
    sides = [Side(*spec) for spec in specs]
    try:
        results, info = compare(sides, cells, args.rounds, args.warmup, args.rep, kw=kw, bwd=args.bwd,
                                kernels=args.kernels)
    finally:
        for side in sides:
            side.close()
    command = common.command(MODULE, argv, hide={args.peer_pythonpath: "$PEER_PYTHONPATH"})
    names = [s[0] for s in specs]
    if args.mods:
        text, name = report_mods(results, info, names, args, command), "vs_fa4_mods.md"
    elif args.decode:
        text, name = report_decode(results, info, names, args, command, kw), "vs_fa4_decode.md"
    else:
        text, name = report(results, info, names, args, command), "vs_fa4_bwd.md" if args.bwd else "vs_fa4.md"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name), "w") as f:
        f.write(text)
    print(text)
    missing = [cell for cell, res in results.items() if not all(isinstance(v, float) for v in res.values())]
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
