"""What the benchmark scripts share: the repository's paths, argument parsers, the per-call timing loop, and
the lines every results table starts with (device, versions, date, the command that reproduces it).

Scripts run as modules from the repository root (``python -m benchmarks.attention.vs_fa4``), so the
checkout's ``flash_attn`` (and through it ``packages/*/flash_attn``) is the one imported. Only the standard
library is imported here at module level: a worker process of the released flash-attn-4 imports this too.
"""
import atexit
import contextlib
import datetime
import os
import platform
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def results_dir():
    """Where this machine's tables of record go: benchmarks/results/h100/ on an H100, else .../h200/ (one current
    table per benchmark and GPU: a run on one card never overwrites the other card's table)."""
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return os.path.join(ROOT, "benchmarks", "results", "h100" if "H100" in name else "h200")


def ints(s):
    """[int] of a comma-separated list ("64,128")."""
    return [int(x) for x in s.split(",") if x.strip()]


def bools(s):
    """[bool] of a comma-separated list of 1/0, true/false, yes/no or "causal"."""
    return [x.strip().lower() in ("1", "true", "yes", "causal") for x in s.split(",") if x.strip()]


def gpu_us(fn, reps=20, warmup=0):
    """Device time per call: the summed durations of the GPU activities (kernels, copies, fills) torch.profiler sees
    over reps calls of fn (after warmup unprofiled ones). What a CUDA-graph-captured call would cost, where the wall
    time of a burst also holds the host's time when the host is the slower side."""
    return sum(kernel_us(fn, reps, warmup).values())


def graph_us(fn, calls=20, replays=20, warmup=3):
    """Wall time per call of ``fn`` replayed from a CUDA graph that holds ``calls`` calls back to back (median of
    ``replays`` replays, CUDA events): the GPU's time including the gaps between a call's kernels, without the
    host's (what a decoding step captured with cg=True costs). None when fn cannot be captured."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError:
        return None
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def kernel_us(fn, reps=20, warmup=0):
    """{activity name: device us per call} of fn's GPU activities (kernels, copies, fills) that torch.profiler sees
    over reps calls (after warmup unprofiled ones), largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = {e.key: e.self_device_time_total / reps for e in prof.key_averages() if e.self_device_time_total > 0}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def per_call_us(fn, n=300, rounds=5, warmup=30, device="cuda", sync_each=False):
    """Median over rounds of the wall time per call of ``fn`` in microseconds, n calls back to back with one
    synchronize per round: on a problem whose GPU work takes a few microseconds, this is the cost of the
    Python path and the launch (the project's per-call metric). ``sync_each``: a synchronize after every
    call too (the latency to the result); on device "cpu" nothing is synchronized."""
    import torch

    def sync():
        if device != "cpu":
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
            if sync_each:
                sync()
        sync()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


_ENV_NAME = re.compile(r"[A-Z][A-Z0-9_]*=")


def env_items(text):
    """{NAME: VALUE} of a comma-separated NAME=VALUE list ("" gives {}). An item that does not start with an
    upper-case NAME= continues the previous value, so that FLASH_ATTN_OVERRIDES / FLASH_ATTN_CUTE_OVERRIDES /
    ..._DISABLE keep their own comma-separated lists: "FLASH_ATTN_CUTE_OVERRIDES=fwd.stages=2,fwd.block_n=96"
    is one variable. ValueError for a first item that is not NAME=VALUE, and for FLASH_ATTN_TRITON_* (read once
    at import: they cannot change inside a process)."""
    env, last = {}, None
    for item in filter(None, (x.strip() for x in text.split(","))):
        if _ENV_NAME.match(item):
            last, _, value = item.partition("=")
            env[last] = value
        elif last is None:
            raise ValueError(f"{text!r}: {item!r} is not NAME=VALUE")
        else:
            env[last] += "," + item
    triton = sorted(n for n in env if n.startswith("FLASH_ATTN_TRITON_"))
    if triton:
        raise ValueError(f"{text!r}: {triton} are read once at import; set them before the process starts")
    return env


def reload_settings():
    """Have the imported flash_attn settings readers (flash_attn.settings, flash_attn.cute.settings) read the
    environment again: they read it once at import, so a script that changes os.environ between calls calls this.
    flash_attn.triton reads FLASH_ATTN_TRITON_OVERRIDES at import only: a change to it needs a new process."""
    for name in ("flash_attn.settings", "flash_attn.cute.settings"):
        module = sys.modules.get(name)
        if module is not None:
            module.reload()


def set_environ(values):
    """Set the environment variables of ``values`` ({NAME: value, or None to unset}) and reload the settings;
    returns the previous values in the same form (set_environ(previous) restores them)."""
    previous = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)
    reload_settings()
    return previous


@contextlib.contextmanager
def environ(values):
    """set_environ(values) for the body of a with statement; the previous values afterwards."""
    previous = set_environ(values)
    try:
        yield
    finally:
        set_environ(previous)


def version(dist):
    """The installed version of a distribution, or "not installed"."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def versions(*dists):
    """"torch 2.x (CUDA 12.x), triton 3.x, ..., Python 3.x" for torch and triton plus ``dists``."""
    import torch

    parts = [f"torch {torch.__version__} (CUDA {torch.version.cuda})", f"triton {version('triton')}"]
    parts += [f"{d} {version(d)}" for d in dists]
    return ", ".join(parts + [f"Python {platform.python_version()}"])


def device_name(device="cuda"):
    """The GPU's name, or "CPU (<processor>)" for a CPU run (a smoke test, not a measurement)."""
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine() or 'cpu'})"


def date():
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}"


def command(module, argv=None, hide=None):
    """The shell command that reproduces this run: ``python -m <module> <argv>`` from the repository root.
    ``hide`` maps literal values (a machine's paths) to the variable to show instead, e.g.
    {peer_path: "$PEER_PYTHONPATH"}."""
    argv = sys.argv[1:] if argv is None else list(argv)
    text = shlex.join(["python", "-m", module, *argv])
    for value, name in (hide or {}).items():
        if value:
            text = text.replace(shlex.quote(value), f'"{name}"').replace(value, f'"{name}"')
    return text


def header(module, argv=None, device="cuda", dists=(), hide=None):
    """The metadata lines a results table starts with (Markdown list items)."""
    return [f"- device: {device_name(device)}",
            f"- versions: {versions(*dists)}",
            f"- date: {date()}",
            f"- command: `{command(module, argv, hide)}`"]


def peer_cwd():
    """A working directory for a process that imports the released flash-attn-4 (whose import name is also
    ``flash_attn``): a fresh folder holding only a link to benchmarks/, so ``python -m benchmarks....`` finds
    the scripts there while ``flash_attn`` comes from the peer's PYTHONPATH, not from this checkout."""
    folder = tempfile.mkdtemp(prefix="flash_attn_peer_")
    atexit.register(shutil.rmtree, folder, True)  # (removes the link, not what it points to)
    os.symlink(os.path.join(ROOT, "benchmarks"), os.path.join(folder, "benchmarks"))
    return folder
