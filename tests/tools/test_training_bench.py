"""benchmarks/training/bench_train.py runs end to end (tiny, on the CPU) and writes its Markdown table."""
import importlib
import os

import torch


def test_bench_train_writes_a_table_with_both_models(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: threads only add contention on a shared CPU
    try:
        _run(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _load_bench():
    # a fresh module per test: the tests replace its functions (measure, flops_per_token) with wrappers
    return importlib.reload(importlib.import_module("benchmarks.training.bench_train"))


def _table_rows(text):
    """{implementation: [tokens/s, step (ms), MFU, peak memory, speedup]} of the Markdown table, as printed."""
    rows = [line for line in text.splitlines() if line.startswith("| ") and "tokens/s" not in line]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in r.strip("|").split("|")] for r in rows)}


def _run(tmp_path):
    bench = _load_bench()
    measured, flops = [], []
    real_measure, real_flops = bench.measure, bench.flops_per_token
    bench.measure = lambda *a, **k: measured.append(real_measure(*a, **k)) or measured[-1]
    bench.flops_per_token = lambda *a, **k: flops.append(real_flops(*a, **k)) or flops[-1]
    assert bench.main(["--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "64",
                       "--batch", "2", "--vocab", "256", "--steps", "2", "--warmup", "1",
                       "--peak-tflops", "1.0", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "train_gpt2_medium.md").read_text()
    rows = _table_rows(text)
    hf, ours = "HF transformers GPT2LMHeadModel (sdpa)", "flash_attn GPTLMHeadModel (fused)"
    assert list(rows) == [hf, ours]
    assert [r["name"] for r in measured] == [hf, ours] and len(flops) == 1
    res = {r["name"]: r for r in measured}
    for name, r in res.items():
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and abs(r["tokens_per_s"] * r["step_ms"] / 1000 - 2 * 64) < 1e-6, r
        tokens, step, mfu, mem, speed = rows[name]
        assert tokens == f"{r['tokens_per_s']:,.0f}" and step == f"{r['step_ms']:.1f}" and mem == "n/a", rows[name]
        # MFU against the given peak (1 TFLOP/s) from the counted FLOPs per token
        assert mfu == f"{100 * flops[0] * r['tokens_per_s'] / 1e12:.1f}%", (mfu, flops, r)
        # speedup: this row's tokens/s over HF's (HF's own row is 1.00x by definition)
        assert speed == f"{r['tokens_per_s'] / res[hf]['tokens_per_s']:.2f}x", (name, speed, res)
    assert rows[hf][4] == "1.00x"
    assert "- command: `python" in text and "torch 2." in text


def test_table_speedup_and_mfu():
    """The table on made-up measurements: speedups against the HF row whatever its position, MFU against the
    peak, error rows, and no speedup without a working HF row."""
    bench = _load_bench()

    def row(name, tps):
        return {"name": name, "tokens_per_s": tps, "step_ms": 128_000 / tps, "loss": 1.0, "peak_gib": None}

    hf = row("HF transformers GPT2LMHeadModel (sdpa)", 1000.0)
    ours = row("flash_attn GPTLMHeadModel (fused)", 2500.0)
    graphs = dict(row("flash_attn GPTLMHeadModel (fused), CUDA graphs", 3100.0), peak_gib=12.345)
    oom = {"name": "flash_attn GPTLMHeadModel (fused) + torch.compile", "error": "out of memory"}
    rows = _table_rows(bench.table([ours, hf, graphs, oom], None, 1e9, 10.0))
    assert rows == {
        ours["name"]: ["2,500", "51.2", "25.0%", "n/a", "2.50x"],
        hf["name"]: ["1,000", "128.0", "10.0%", "n/a", "1.00x"],
        graphs["name"]: ["3,100", "41.3", "31.0%", "12.3", "3.10x"],
        oom["name"]: ["out of memory", "", "", "", ""],
    }
    # without an HF row (--no-hf), or with one that failed: no speedup; without a peak: no MFU
    for results in ([ours], [dict(hf, error="out of memory", tokens_per_s=None), ours]):
        assert _table_rows(bench.table(results, None, 1e9, None))[ours["name"]] == ["2,500", "51.2", "n/a", "n/a",
                                                                                   "n/a"]


def test_bench_train_ab_rows_set_and_restore_the_environment(tmp_path, monkeypatch):
    bench = _load_bench()
    monkeypatch.delenv("FLASH_ATTN_FP32_WGRAD", raising=False)
    seen = []
    real = bench.measure

    def measure(name, cfg, args, model=None):
        seen.append((name, os.environ.get("FLASH_ATTN_FP32_WGRAD")))
        return real(name, cfg, args, model)

    monkeypatch.setattr(bench, "measure", measure)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert bench.main(["--device", "cpu", "--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "32",
                           "--batch", "1", "--vocab", "256", "--steps", "1", "--warmup", "1", "--no-hf",
                           "--ab", "FLASH_ATTN_FP32_WGRAD=1", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert seen == [("flash_attn GPTLMHeadModel (fused)", None),
                    ("flash_attn GPTLMHeadModel (fused), FLASH_ATTN_FP32_WGRAD=1", "1")]
    assert "FLASH_ATTN_FP32_WGRAD" not in os.environ
    text = (tmp_path / "train_gpt2_medium.md").read_text()
    assert "| flash_attn GPTLMHeadModel (fused), FLASH_ATTN_FP32_WGRAD=1 |" in text
