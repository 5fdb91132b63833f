"""Training throughput of a GPT-2-medium-sized model: flash_attn.training against plain HF transformers.

Both run one full training step per iteration through the same Trainer loop (data, bf16 autocast, loss,
backward, gradient clipping, fused AdamW): ours is GPTLMHeadModel with FlashAttention, the fused
dropout-add-LayerNorm and MLP kernels and the fused cross-entropy; the peer is transformers'
GPT2LMHeadModel with attn_implementation="sdpa" and torch's cross-entropy. Reported: tokens/s, MFU against
the GPU's dense bf16 peak (989 TFLOP/s on H100/H200), peak memory and the speedup over the peer. FLOPs per
token are 6 * (matmul parameters) + 6 * n_layer * seq_len * d_model (causal attention counted at half of
the full square), the same count for both models.

    python -m benchmarks.training.bench_train                       # 24 layers, d=1024, seq 2048 (GPU); ours eager
                                                           # and with train.cuda_graph (--cuda-graph)
    python -m benchmarks.training.bench_train --quick               # 4 layers, fewer steps
    python -m benchmarks.training.bench_train --device cpu --layers 2 --hidden 64 --heads 4 --seq 64 --batch 2 \
        --vocab 256 --steps 2 --warmup 1                   # smoke test of the script itself

Writes a Markdown table (GPU, versions, date, command) to --out/train_gpt2_medium.md.
"""
import argparse
import contextlib
import gc
import os
import sys
import tempfile
import time

import torch

from benchmarks import common
from flash_attn.training.config import load_config
from flash_attn.training.metrics import peak_tflops
from flash_attn.training.trainer import Trainer


def make_config(args, out_dir, ours, compile=False, graph=False):
    overrides = [f"train.cuda_graph={str(graph).lower()}",
        f"out_dir={out_dir}", "checkpoint.resume=none", "log.progress=off",
        f"model.vocab_size={args.vocab}", f"model.n_positions={args.seq}", f"model.n_embd={args.hidden}",
        f"model.n_layer={args.layers}", f"model.n_head={args.heads}", "model.dropout=0.0",
        f"train.seq_len={args.seq}", f"train.micro_batch_size={args.batch}", "train.grad_accum=1",
        f"train.device={args.device}", f"train.compile={str(compile).lower()}",
        f"train.activation_checkpointing={str(args.activation_checkpointing).lower()}",
        # Enough generated text for every step's distinct windows.
        f"data.synthetic_chars={max(2_000_000, 2 * args.seq * args.batch * (args.steps + args.warmup))}",
        f"train.loss={'auto' if ours else 'torch'}",
    ]
    if args.device == "cpu":
        overrides.append("train.dtype=fp32")
    return load_config("tiny", overrides)


@contextlib.contextmanager
def env_set(spec):
    """Set the VAR=VALUE pairs of spec (comma-separated; common.env_items, so FLASH_ATTN_OVERRIDES' own list stays
    one value) for the block and have flash_attn read its settings again, then restore both; yields the pairs as
    written."""
    try:
        pairs = common.env_items(spec)
    except ValueError as e:
        raise SystemExit(f"--ab expects VAR=VALUE[,VAR=VALUE]: {e}") from None
    if not pairs:
        raise SystemExit(f"--ab expects VAR=VALUE[,VAR=VALUE], got {spec!r}")
    cute = any(k.startswith("FLASH_ATTN_CUTE_") for k in pairs)
    with common.environ(pairs):
        if cute:
            _clear_cute_kernels()
        try:
            yield ", ".join(f"{k}={v}" for k, v in pairs.items())
        finally:
            if cute:
                _clear_cute_kernels()


def _clear_cute_kernels():
    """Empty flash_attn.cute's in-memory kernel tables (keyed by the call, not by the settings), so that a row
    under other FLASH_ATTN_CUTE_* settings gets their kernels (from the disk cache, keyed by the config)."""
    kernels = sys.modules.get("flash_attn.cute.kernels")
    if kernels is not None:
        kernels._kernels.clear()
        kernels._bwd_kernels.clear()


def hf_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.hidden, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        activation_function="gelu_new", attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def measure(name, cfg, args, model=None):
    """Steps/s of Trainer.train_step after warmup steps; returns a result dict (or one saying why not)."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = None
    try:
        trainer = Trainer(cfg, model=model)
        for _ in range(args.warmup):
            loss, _ = trainer.train_step()
        float(loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss, _ = trainer.train_step()
        final_loss = float(loss)  # waits for the GPU
        seconds = time.perf_counter() - t0
    except torch.cuda.OutOfMemoryError:
        return {"name": name, "error": "out of memory"}
    finally:
        del trainer
        gc.collect()
    tokens_per_s = args.batch * args.seq * args.steps / seconds
    return {"name": name, "tokens_per_s": tokens_per_s, "step_ms": 1000 * seconds / args.steps,
            "loss": final_loss,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def flops_per_token(args, cfg):
    from flash_attn.training.model import build_model, flops_per_token as count

    return count(build_model(cfg.model, "meta"), cfg.model, args.seq)


def table(results, args, flops, peak):
    base = next((r for r in results if r["name"].startswith("HF") and "error" not in r), None)
    lines = ["| implementation | tokens/s | step (ms) | MFU | peak memory (GiB) | speedup vs HF |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['error']} | | | | |")
            continue
        mfu = f"{100 * flops * r['tokens_per_s'] / (peak * 1e12):.1f}%" if peak else "n/a"
        mem = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a"
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "n/a"
        lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | {mfu} | {mem} | {speed} |")
    return "\n".join(lines)


def header(args, flops, peak, argv=None):
    device = torch.device(args.device)
    return "\n".join([
        f"# Training throughput: GPT-2 ({args.layers} layers, d={args.hidden}, {args.heads} heads, "
        f"seq {args.seq}, micro-batch {args.batch}, vocab {args.vocab})", "",
        *common.header("benchmarks.training.bench_train", argv, device=args.device,
                       dists=("transformers", "flash-attn")),
        f"- {args.steps} timed steps after {args.warmup} warmup steps; one step = forward, backward, clipping "
        f"and AdamW ({'fused' if device.type == 'cuda' else 'not fused'}) on {args.batch * args.seq} tokens; "
        + ("bf16 autocast" if device.type == "cuda" else "fp32"),
        f"- FLOPs per token {flops / 1e9:.2f} GFLOP (6 x matmul params + causal attention); MFU against "
        + (f"{peak:.0f} TFLOP/s" if peak else "an unknown peak (not reported)"),
        f"- activation checkpointing: {'on' if args.activation_checkpointing else 'off'}; torch.compile "
        f"(ours): {'on' if args.compile else 'off'}",
        # A/B runs differ only in these (e.g. FLASH_ATTN_FP32_WGRAD, FLASH_ATTN_WEIGHT_CAST_CACHE); --ab rows
        # add their own on top.
        "- FLASH_ATTN_* switches set: " + (", ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                                    if k.startswith("FLASH_ATTN_")) or "none"),
        "", ""])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=common.results_dir())
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="also run ours under torch.compile")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    p.add_argument("--cuda-graph", choices=("off", "on", "both"), default=None,
                   help="ours with train.cuda_graph: off, on, or both rows (--ab rows use graphs unless off); "
                        "default both on CUDA, off on a CPU")
    p.add_argument("--ab", action="append", default=[], metavar="VAR=VALUE[,VAR=VALUE]",
                   help="also measure ours with these environment variables set, in this process (one row per "
                        "--ab; the settings are read again, e.g. FLASH_ATTN_FP32_WGRAD=1 or "
                        "FLASH_ATTN_OVERRIDES=linear.wgrad_bias=torch; not FLASH_ATTN_TRITON_*, read at import)")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="override the GPU's peak for MFU")
    p.add_argument("--quick", action="store_true", help="4 layers, 5 timed steps after 2 warmup steps")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.steps, args.warmup = 4, 5, 2
    device = torch.device(args.device)
    if args.cuda_graph is None:
        args.cuda_graph = "both" if device.type == "cuda" else "off"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    peak = peak_tflops(device, dtype, args.peak_tflops)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        ours_cfg = make_config(args, os.path.join(tmp, "ours"), ours=True)
        flops = flops_per_token(args, ours_cfg)
        if not args.no_hf:
            results.append(measure("HF transformers GPT2LMHeadModel (sdpa)",
                                   make_config(args, os.path.join(tmp, "hf"), ours=False), args, hf_model(args)))
        graphed = args.cuda_graph != "off"
        if args.cuda_graph != "on":
            results.append(measure("flash_attn GPTLMHeadModel (fused)", ours_cfg, args))
        if graphed:
            results.append(measure("flash_attn GPTLMHeadModel (fused), CUDA graphs",
                                   make_config(args, os.path.join(tmp, "graph"), ours=True, graph=True), args))
        for spec in args.ab:
            with env_set(spec) as pairs:
                results.append(measure(f"flash_attn GPTLMHeadModel (fused){', CUDA graphs' if graphed else ''}, "
                                       f"{pairs}", make_config(args, os.path.join(tmp, "ab"), ours=True,
                                                               graph=graphed), args))
        if args.compile:
            results.append(measure("flash_attn GPTLMHeadModel (fused) + torch.compile",
                                   make_config(args, os.path.join(tmp, "compiled"), ours=True, compile=True), args))
    text = header(args, flops, peak, argv) + table(results, args, flops, peak) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "train_gpt2_medium.md")
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
