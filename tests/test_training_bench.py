"""benchmarks/bench_train.py runs end to end (tiny, on the CPU) and writes its Markdown table."""
import importlib.util
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_train_writes_a_table_with_both_models(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: threads only add contention on a shared CPU
    try:
        _run(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _run(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_train", os.path.join(ROOT, "benchmarks", "bench_train.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4", "--seq", "64",
                       "--batch", "2", "--vocab", "256", "--steps", "2", "--warmup", "1",
                       "--peak-tflops", "1.0", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "train_gpt2_medium.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "tokens/s" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| HF transformers GPT2LMHeadModel (sdpa)",
                                                 "| flash_attn GPTLMHeadModel (fused)"]
    assert "1.00x" in rows[0] and "%" in rows[1]  # speedup against HF, MFU against the given peak
    assert "- command: `python" in text and "torch 2." in text


def test_bench_train_ab_rows_set_and_restore_the_environment(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_train", os.path.join(ROOT, "benchmarks", "bench_train.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
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
