"""flash_attn.cute's compiled-kernel cache: the precompile entry point fills a disk cache without a GPU,
a new process loads from it without compiling (without even importing the CuTeDSL compiler), a bad
entry is ignored and rebuilt, concurrent processes compile an entry once, and the key follows the
sources. Two kernels are compiled in this file (the precompiled one, and one rebuild); the rest
reuses them. On a Hopper GPU (marked gpu) a kernel loaded from disk runs and matches the reference."""
import json
import os
import queue
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

pytest.importorskip("cutlass.cute")
pytest.importorskip("tvm_ffi")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:  # the checkout's flash_attn/__init__ also finds it; this keeps the test standalone
    sys.path.insert(0, _PKG)

from flash_attn.cute import cache, kernels, precompile, settings  # noqa: E402
from _cute_table import swap_kernels as _swap_kernels  # noqa: E402

CONFIG = (torch.bfloat16, 128, False, "sm_90a")  # the one precompiled configuration (memory key: + local, softcap)


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, _PKG] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(extra)
    return env


# the direct O store (fwd.tma_o=0) and no short-key kernel of its own (fwd.persistent=0: no short-key persistent
# kernel either)
_OVERRIDES = "fwd.tma_o=0,fwd.persistent=0"



@pytest.fixture(autouse=True)
def _direct_o_store(cute_env):
    """The tests' configuration (CONFIG: bf16 d128 non-causal) with the direct O store and no short-key kernel
    of its own, as the precompiled fixture builds it: in-process keys, and the child processes (which inherit
    the environment), agree with it (unset, d128 takes the TMA O store, and its short keys the persistent
    kernel: other entries)."""
    cute_env(OVERRIDES=_OVERRIDES)


@pytest.fixture(scope="module")
def precompiled(tmp_path_factory):
    """A cache folder filled by the command line entry point, in its own process."""
    out = tmp_path_factory.mktemp("precompiled")
    cmd = [sys.executable, "-m", "flash_attn.cute.precompile", "--arch", "sm_90a", "--out", str(out),
           "--dtypes", "bf16", "--head-dims", "128", "--causal", "false"]
    # the direct O store, one kernel (see _direct_o_store)
    env = _env(FLASH_ATTN_CUTE_OVERRIDES=_OVERRIDES)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bf16 d128 full  : compiled" in proc.stdout, proc.stdout
    return out


@pytest.fixture
def no_compile(monkeypatch):
    """Make compiling fail the test: whatever runs under it must come from memory or disk."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"compile_fwd{args} called")

    monkeypatch.setattr(kernels, "compile_fwd", refuse)


def _copy_entry(src, dst):
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if not path.name.endswith(".lock"):
            shutil.copy2(path, dst / path.name)
    return dst


def _names():
    _, key, name, symbol = kernels._entry(*CONFIG)
    return key, name, symbol


def test_precompile_writes_a_complete_entry(precompiled):
    key, name, symbol = _names()
    files = kernels.disk_entry(*CONFIG, root=precompiled)
    assert set(files) == ({"o", "so"} if cache._c_compiler() else {"o"})
    manifest = json.loads((precompiled / f"{name}.json").read_text())
    assert manifest["key"] == key and manifest["symbol"] == symbol
    assert manifest["config"] == {"kernel": "FlashFwdSm90", "dtype": "bf16", "head_dim": 128, "stages": 3,
                                  "causal": False,
                                  "local": False, "softcap": False, "arch": "sm_90a",
                                  "abi": "tvm-ffi-env-stream"}
    assert manifest["source"] == cache.source_hash()
    # no temporary file is left behind, and only the one configuration was built
    assert sorted(p.suffix for p in precompiled.iterdir()) == sorted([".json", ".lock"] + [f".{e}" for e in files])


def test_precompile_again_keeps_the_entry(precompiled, no_compile, capsys):
    # (_direct_o_store: as the fixture built it, no short-key kernel)
    assert precompile.main(["--out", str(precompiled), "--dtypes", "bf16", "--head-dims", "128",
                            "--causal", "false"]) == 0
    assert "already cached" in capsys.readouterr().out


_CHILD = textwrap.dedent("""
    import json, sys, time
    import torch
    from flash_attn.cute import kernels

    def refuse(*args, **kwargs):
        raise AssertionError("compile_fwd called")

    kernels.compile_fwd = refuse
    t0 = time.perf_counter()
    fn = kernels.fwd_kernel(torch.bfloat16, 128, False, "sm_90a")
    load_s = time.perf_counter() - t0
    q = torch.zeros(1, 128, 16, 128, dtype=torch.bfloat16)
    try:  # the real kernel's TVM-FFI wrapper checks its arguments (on the CPU: the device type)
        fn(q, q, q, q, torch.zeros(1, 16, 128), 0.1, 0.0, 0, 0)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"origin": kernels._origins[(torch.bfloat16, 128, False, "sm_90a", False, False)], "load_s": load_s,
                      "cutlass_imported": "cutlass" in sys.modules, "error": error}))
""")


def _run_child(cache_dir, code=_CHILD, **env):
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=_env(FLASH_ATTN_CUTE_CACHE=str(cache_dir), **env))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_new_process_loads_from_disk_without_compiling(precompiled):
    if not cache._c_compiler():
        pytest.skip("no C compiler: entries hold objects only, which load through CuTeDSL")
    result = _run_child(precompiled)
    assert result["origin"] == "so"
    assert not result["cutlass_imported"], "loading from disk must not import the CuTeDSL compiler"
    assert "expected device_type=cuda" in result["error"], result["error"]
    print(f"\nnew process, warm disk cache: kernel loaded in {result['load_s'] * 1e3:.1f} ms")


def test_object_only_entry_loads_through_cutedsl(precompiled, tmp_path, monkeypatch, no_compile):
    """An entry written where no C compiler was found: without one here either it loads through
    CuTeDSL's load_module; with one it is linked once, in place, for the next processes."""
    _, name, _ = _names()
    root = _copy_entry(precompiled, tmp_path / "c")
    (root / f"{name}.so").unlink(missing_ok=True)
    manifest = json.loads((root / f"{name}.json").read_text())
    manifest["sha256"].pop("so", None)
    (root / f"{name}.json").write_text(json.dumps(manifest))
    real_cc = cache._c_compiler
    monkeypatch.setattr(cache, "_c_compiler", lambda: None)
    fn, how = kernels.load_or_build(*CONFIG, root=root)
    assert how == "o" and callable(fn)
    assert set(kernels.disk_entry(*CONFIG, root=root)) == {"o"}
    monkeypatch.setattr(cache, "_c_compiler", real_cc)
    if real_cc():
        fn, how = kernels.load_or_build(*CONFIG, root=root)
        assert how == "so" and set(kernels.disk_entry(*CONFIG, root=root)) == {"o", "so"}


def test_failing_linker_falls_back_to_the_object(precompiled, tmp_path, monkeypatch, no_compile):
    _, name, _ = _names()
    root = _copy_entry(precompiled, tmp_path / "c")
    (root / f"{name}.so").unlink(missing_ok=True)
    monkeypatch.setattr(cache, "_c_compiler", lambda: shutil.which("false"))
    fn, how = kernels.load_or_build(*CONFIG, root=root)
    assert how == "o" and any("linking" in n for n in cache.notes())


def test_warm_process_never_reloads(precompiled, cute_env, monkeypatch, no_compile):
    cute_env(CACHE=str(precompiled))
    _swap_kernels(monkeypatch, {})
    monkeypatch.setattr(kernels, "_origins", dict(kernels._origins))
    loads = []
    real_load = cache.DiskCache.load
    monkeypatch.setattr(cache.DiskCache, "load", lambda self, *a, **k: loads.append(a) or real_load(self, *a, **k))
    fn = kernels.fwd_kernel(*CONFIG)
    assert kernels._origins[CONFIG + (False, False)] in ("so", "o") and len(loads) == 1
    for _ in range(3):
        assert kernels.fwd_kernel(*CONFIG) is fn
    assert len(loads) == 1


def _corrupt(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["manifest-garbage", "manifest-other-key", "manifest-other-format",
                                    "both-binaries-corrupt", "both-binaries-truncated", "binaries-missing"])
def test_bad_entry_is_a_miss(precompiled, tmp_path, damage):
    key, name, _ = _names()
    root = _copy_entry(precompiled, tmp_path / "c")
    man, o, so = (root / f"{name}.{e}" for e in ("json", "o", "so"))
    if damage == "manifest-garbage":
        man.write_bytes(b"\x00{not json")
    elif damage.startswith("manifest-other"):
        manifest = json.loads(man.read_text())
        manifest["key" if damage.endswith("key") else "format"] = "something else"
        man.write_text(json.dumps(manifest))
    for path in (o, so):
        if damage == "both-binaries-corrupt" and path.exists():
            _corrupt(path)
        elif damage == "both-binaries-truncated" and path.exists():
            path.write_bytes(path.read_bytes()[:100])
        elif damage == "binaries-missing":
            path.unlink(missing_ok=True)
    assert cache.DiskCache(root).load(name, key) == (None, None)
    assert kernels.disk_entry(*CONFIG, root=root) == {}


def test_corrupt_shared_library_is_relinked_from_the_object(precompiled, tmp_path, no_compile):
    if not cache._c_compiler():
        pytest.skip("no C compiler")
    _, name, _ = _names()
    root = _copy_entry(precompiled, tmp_path / "c")
    _corrupt(root / f"{name}.so")
    fn, how = kernels.load_or_build(*CONFIG, root=root)
    assert how == "so" and set(kernels.disk_entry(*CONFIG, root=root)) == {"o", "so"}


def test_corrupt_entry_is_rebuilt(precompiled, tmp_path):
    """The second (and last) compile of this file: an entry whose binaries are both damaged is compiled
    again and rewritten; the next process loads the new one."""
    _, name, _ = _names()
    root = _copy_entry(precompiled, tmp_path / "c")
    for ext in ("o", "so"):
        if (root / f"{name}.{ext}").exists():
            _corrupt(root / f"{name}.{ext}")
    calls = []
    real = kernels.compile_fwd
    kernels.compile_fwd = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        fn, how = kernels.load_or_build(*CONFIG, root=root)
    finally:
        kernels.compile_fwd = real
    assert how == "compiled" and len(calls) == 1 and callable(fn)
    assert kernels.disk_entry(*CONFIG, root=root)
    assert not [p for p in root.iterdir() if ".tmp" in p.name]
    if cache._c_compiler():
        assert _run_child(root)["origin"] == "so"


def test_unwritable_cache_compiles_in_memory(tmp_path, monkeypatch):
    """A cache folder that cannot be created (here: below a file) never fails the call."""
    class Compiled:
        def __tvm_ffi_object__(self):
            return kernel

    def kernel(*args):
        return None

    (tmp_path / "file").write_text("")
    monkeypatch.setattr(kernels, "compile_fwd", lambda *a, **k: Compiled())
    fn, how = kernels.load_or_build(*CONFIG, root=tmp_path / "file" / "cache")
    assert fn is kernel and how == "compiled"


def _blocked_on_flock(pid, path):
    """Whether /proc/locks lists process ``pid`` as waiting (``->``) for a flock on ``path``; None where the
    kernel's lock table cannot be read (not Linux)."""
    try:
        with open("/proc/locks") as f:
            table = f.read()
    except OSError:
        return None
    inode = os.stat(path).st_ino
    for line in table.splitlines():
        fields = line.split()
        if "->" in fields and "FLOCK" in fields:
            rest = fields[fields.index("->") + 1:]  # FLOCK ADVISORY WRITE pid maj:min:inode start end
            if len(rest) >= 5 and rest[3] == str(pid) and rest[4].rsplit(":", 1)[-1] == str(inode):
                return True
    return False


def test_concurrent_builder_waits_for_the_lock_holder(precompiled, tmp_path, no_compile):
    """While one process holds an entry's lock (it is compiling), another that misses waits for it and
    then loads what it wrote, instead of compiling the same kernel again. The child proves the wait: it
    misses, finds the lock held (a non-blocking probe of the same flock), is seen blocked on it in the
    kernel's lock table (Linux), asks for it before the holder releases and gets it only after, and then
    loads the holder's entry under the lock."""
    _, name, _ = _names()
    root = tmp_path / "c"
    disk = cache.DiskCache(root)
    child = textwrap.dedent("""
        import contextlib, fcntl, json, sys, time
        import torch
        from flash_attn.cute import cache, kernels

        def refuse(*args, **kwargs):
            raise AssertionError("compile_fwd called")

        kernels.compile_fwd = refuse
        events = {"loads": [], "writers": []}
        real_load, real_writer = cache.DiskCache.load, cache.DiskCache.writer

        def load(self, name, key, locked=False):
            fn, how = real_load(self, name, key, locked)
            events["loads"].append([locked, how])
            return fn, how

        @contextlib.contextmanager
        def writer(self, name):
            with open(self.paths(name)["lock"], "a") as f:  # is the lock held by someone else?
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    held = True
                else:
                    held = False
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)
            w = {"found_held": held, "requested": time.time()}
            events["writers"].append(w)
            print("waiting" if held else "free", flush=True)
            with real_writer(self, name):
                w["acquired"] = time.time()
                yield

        cache.DiskCache.load, cache.DiskCache.writer = load, writer
        print("ready", flush=True)
        fn = kernels.fwd_kernel(torch.bfloat16, 128, False, "sm_90a")
        print(json.dumps({"origin": kernels._origins[(torch.bfloat16, 128, False, "sm_90a", False, False)],
                          "done": time.time(), **events}), flush=True)
    """)
    proc = None
    try:
        with disk.writer(name):
            lock = disk.paths(name)["lock"]
            proc = subprocess.Popen([sys.executable, "-c", child], cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=_env(FLASH_ATTN_CUTE_CACHE=str(root)))
            lines = queue.Queue()
            reader = threading.Thread(target=lambda: [lines.put(x.strip()) for x in iter(proc.stdout.readline, "")],
                                      daemon=True)
            reader.start()

            def next_line():
                try:
                    return lines.get(timeout=120)
                except queue.Empty:
                    return "(nothing within 120 s)"

            assert next_line() == "ready"
            # the child missed and found the lock held; it now asks for it
            line = next_line()
            assert line == "waiting", line
            deadline = time.time() + 60
            while (blocked := _blocked_on_flock(proc.pid, lock)) is False and time.time() < deadline:
                assert proc.poll() is None, proc.stderr.read()
                time.sleep(0.01)
            assert blocked is not False, "the child never blocked on the entry's lock"
            if blocked is None:  # no lock table to look at: give the child time to reach flock
                time.sleep(0.5)
            assert proc.poll() is None, proc.stderr.read()
            staging = _copy_entry(precompiled, tmp_path / "staging")
            for path in sorted(staging.iterdir(), key=lambda p: p.suffix == ".json"):  # manifest last
                os.replace(path, root / path.name)
            released = time.time()
        proc.wait(timeout=300)
        reader.join(timeout=30)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    out = [lines.get_nowait() for _ in range(lines.qsize())]
    assert proc.returncode == 0, "\n".join(out) + proc.stderr.read()
    result = json.loads(out[-1])
    assert result["origin"] in ("so", "o")
    # one miss without the lock, then, under the lock it waited for, a hit on what the holder wrote
    assert result["loads"] == [[False, None], [True, result["origin"]]], result["loads"]
    (w,) = result["writers"]
    assert w["found_held"] and w["requested"] < released <= w["acquired"] <= result["done"], (w, released)


def test_key_follows_sources_config_and_versions(tmp_path, monkeypatch):
    config = kernels.fwd_config(*CONFIG).key()
    key = cache.entry_key(config)
    assert cache.entry_key(dict(config)) == key  # deterministic
    for change in ({"dtype": "fp16"}, {"head_dim": 64}, {"causal": True}, {"arch": "sm_100a"}, {"abi": "cute"}):
        assert cache.entry_key({**config, **change}) != key, change
    # the package sources: a copy hashes the same until a kernel file changes
    copy = tmp_path / "cute"
    shutil.copytree(cache._PKG_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert cache.source_hash(copy) == cache.source_hash()
    with open(copy / "flash_fwd_sm90.py", "a") as f:
        f.write("\n# a change\n")
    cache._memo.pop(("source", str(copy)))
    changed = cache.source_hash(copy)
    assert changed != cache.source_hash()
    monkeypatch.setitem(cache._memo, ("source", str(cache._PKG_DIR)), changed)
    assert cache.entry_key(config) != key
    monkeypatch.undo()
    assert cache.entry_key(config) == key
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi", "flash-attn-4"):
        monkeypatch.setitem(cache._memo, "env", {**cache.environment(), dist: "0.0.0-other"})
        assert cache.entry_key(config) != key, dist
        monkeypatch.undo()


def test_stale_temporary_files_are_swept(tmp_path):
    _, name, _ = _names()
    old, fresh = tmp_path / f".{name}.o.1.aa.tmp.o", tmp_path / f".{name}.so.2.bb.tmp.so"
    for path in (old, fresh):
        path.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    cache.DiskCache(tmp_path)._sweep(name)
    assert not old.exists() and fresh.exists()


def test_cache_dir_from_environment(cute_env, monkeypatch, tmp_path):
    assert cache.ENV_VAR == settings.CACHE == "FLASH_ATTN_CUTE_CACHE"
    cute_env(CACHE=str(tmp_path))
    assert cache.cache_dir() == tmp_path
    for off in ("0", "off", "none"):
        cute_env(CACHE=off)
        assert cache.cache_dir() is None
    cute_env(CACHE=None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cute_env()  # (read once: settings.reload)
    assert cache.cache_dir() == tmp_path / "flash_attn_cute"


# ----------------------------------------------------------------------------------------------------
# On a Hopper GPU


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k,heads,heads_kv", [(1, 128, 128, 16, 16), (2, 113, 203, 4, 2)])
def test_kernel_loaded_from_disk_matches_reference(precompiled, cute_env, monkeypatch, no_compile, batch, seqlen_q,
                                                   seqlen_k, heads, heads_kv):
    from flash_attn.cute import flash_attn_func
    from flash_attn.testing import assert_close_to_ref, attention_lse_ref, attention_ref

    cute_env(CACHE=str(precompiled))
    _swap_kernels(monkeypatch, {})
    monkeypatch.setattr(kernels, "_origins", dict(kernels._origins))
    torch.manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen_k, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, seqlen_k, heads_kv, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = flash_attn_func(q, k, v, return_lse=True)
    torch.cuda.synchronize()
    assert kernels._origins[CONFIG + (False, False)] in ("so", "o")
    out_ref, _ = attention_ref(q, k, v)
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True)
    assert_close_to_ref(out, out_ref, out_pt)
    assert (lse - attention_lse_ref(q, k)).abs().max().item() < 1e-2
    # a second call on another stream runs on that stream (the kernel takes torch's current stream)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out2, _ = flash_attn_func(q, k, v)
    s.synchronize()
    assert torch.equal(out2, out)
