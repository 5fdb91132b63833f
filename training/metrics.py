"""Training output: metrics files (JSONL, optional CSV), an optional TensorBoard writer, the progress bar,
the loss plot, and the peak FLOP/s table behind MFU."""
import csv
import json
import os
import sys
import time

import torch

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) of the SXM parts, by a substring of the device name.
PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("H800", 989.0), ("GH200", 989.0), ("B200", 2250.0),
                    ("A100", 312.0), ("A800", 312.0), ("L40S", 362.0), ("A10G", 70.0), ("L4", 121.0))


def peak_tflops(device, dtype, configured=0.0):
    """Peak FLOP/s of one device in TFLOP/s for MFU: the configured value, else the bf16 table entry for a
    known CUDA GPU under bf16, else None (no MFU is reported)."""
    if configured > 0:
        return configured
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_TFLOPS:
        if key in name:
            return value
    return None


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
    """Appends records to out_dir/metrics.jsonl (and metrics.csv, TensorBoard). On a resumed run the records
    after the resumed step are dropped first, so the files hold one continuous curve."""

    CSV_FIELDS = ("step", "split", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "elapsed_s")

    def __init__(self, out_dir, resume_step=0, write_csv=False, tensorboard="auto"):
        os.makedirs(out_dir, exist_ok=True)
        self.jsonl_path = os.path.join(out_dir, "metrics.jsonl")
        self.csv_path = os.path.join(out_dir, "metrics.csv") if write_csv else None
        kept = []
        if os.path.isfile(self.jsonl_path):
            kept = [r for r in read_jsonl(self.jsonl_path) if resume_step > 0 and r["step"] <= resume_step]
        self.records = kept
        self._rewrite()
        self.tb = None
        if tensorboard != "off":
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                if tensorboard == "on":
                    raise RuntimeError("log.tensorboard=on needs the tensorboard package: pip install tensorboard")
            else:
                self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=resume_step + 1)

    def _rewrite(self):
        with open(self.jsonl_path, "w") as f:
            for r in self.records:
                f.write(json.dumps(r) + "\n")
        if self.csv_path is not None:
            with open(self.csv_path, "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=self.CSV_FIELDS, extrasaction="ignore")
                w.writeheader()
                w.writerows(self.records)

    def write(self, record):
        self.records.append(record)
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.csv_path is not None:
            with open(self.csv_path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.CSV_FIELDS, extrasaction="ignore").writerow(record)
        if self.tb is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
                if record.get(key) is not None:
                    self.tb.add_scalar(f"{record['split']}/{key}", record[key], record["step"])

    def close(self):
        if self.tb is not None:
            self.tb.close()


def plot_losses(records, path, title=""):
    """Train and validation loss against step as a PNG; returns False (writes nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for split, style in (("train", "-"), ("val", "o-")):
        points = [(r["step"], r["loss"]) for r in records if r["split"] == split]
        if points:
            ax.plot(*zip(*points), style, label=split, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _human(n):
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


class Progress:
    """One status line per logged step: a redrawn bar on a terminal, plain lines otherwise (logs, CI)."""

    def __init__(self, total, start=0, mode="auto", stream=None, width=24):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode
        self.total = total
        self.width = width
        self.t0 = time.perf_counter()
        self.start = start

    def update(self, step, loss, tokens_per_s, mfu=None, extra=""):
        if self.mode == "off":
            return
        done = step / self.total
        parts = [f"step {step}/{self.total}", f"loss {loss:.4f}", f"{_human(tokens_per_s)} tok/s"]
        if mfu is not None:
            parts.append(f"MFU {100 * mfu:.1f}%")
        if extra:
            parts.append(extra)
        if self.mode == "bar":
            filled = int(self.width * done)
            elapsed = time.perf_counter() - self.t0
            rate = (step - self.start) / elapsed if elapsed > 0 else 0.0
            eta = (self.total - step) / rate if rate > 0 else 0.0
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r[{bar}] " + " | ".join(parts) + f" | eta {eta:.0f}s ")
        else:
            self.stream.write(" | ".join(parts) + "\n")
        self.stream.flush()

    def message(self, text):
        if self.mode == "off":
            return
        if self.mode == "bar":
            self.stream.write("\n")
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self):
        if self.mode == "bar":
            self.stream.write("\n")
            self.stream.flush()
