"""flash_attn.cute's shipped kernels (cache.PREBUILT_DIR, filled by ``precompile --prebuilt`` before the wheel
is built): a new process whose own cache is empty loads a shipped entry without compiling or importing the
CuTeDSL compiler, the run time never writes the shipped folder, an entry of another key there is not loaded,
the source hash leaves the folder out, and the wheel packs it (and, installed, loads it). One kernel (bf16 d64
non-causal, default configuration: one entry) is compiled for the whole file. Everything runs on a snapshot of
packages/flash-attn-4 (its own ``_prebuilt`` folder, its own source hash; the in-process keys take that hash), so
the checkout's folder stays empty and edits made to the checkout meanwhile change no key here."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

pytest.importorskip("cutlass.cute")
pytest.importorskip("tvm_ffi")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:  # the checkout's flash_attn/__init__ also finds it; this keeps the test standalone
    sys.path.insert(0, _PKG)

from flash_attn.cute import cache, kernels  # noqa: E402

CONFIG = (torch.bfloat16, 64, False, "sm_90a")  # default settings: one kernel, no short- or long-key one of its own
MEM_KEY = CONFIG + (False, False)

if not cache._c_compiler():
    pytest.skip("no C compiler: precompile --prebuilt refuses to ship object-only entries", allow_module_level=True)


def _env(pythonpath, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("FLASH_ATTN_CUTE_OVERRIDES", "FLASH_ATTN_CUTE_DISABLE")}
    env["PYTHONPATH"] = str(pythonpath)  # ahead of the checkout in flash_attn.__path__ (pkgutil.extend_path)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    """A snapshot of packages/flash-attn-4 (sources and pyproject.toml): (its root, its flash_attn/cute, its
    source hash)."""
    root = tmp_path_factory.mktemp("fa4")
    ignore = shutil.ignore_patterns("__pycache__", cache.PREBUILT)
    shutil.copytree(os.path.join(_PKG, "flash_attn", "cute"), root / "flash_attn" / "cute", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(os.path.join(_PKG, name), root / name)
    cute = root / "flash_attn" / "cute"
    return root, cute, cache.source_hash(cute)


@pytest.fixture(autouse=True)
def _snapshot_keys(pkg, cute_env, monkeypatch):
    """In-process keys are those of the snapshot (the subprocesses' sources), with default settings."""
    cute_env()
    monkeypatch.setitem(cache._memo, ("source", str(cache._PKG_DIR)), pkg[2])


_PRECOMPILE = ["-m", "flash_attn.cute.precompile", "--prebuilt", "--dtypes", "bf16", "--head-dims", "64",
               "--causal", "false", "--no-backward"]


OTHER_FLAVOUR = "fwd-sm_90a-bf16-d64-full-fedcba9876543210"  # the same entry built under another runtime flavour


@pytest.fixture(scope="module")
def shipped(pkg):
    """The snapshot's shipped folder, filled by ``precompile --prebuilt`` in its own process; it held a stale
    entry's files and a lock before, which the command removes, and the entry of another CUDA flavour of CuTeDSL's
    runtime (a release fills the folder once per flavour), which it keeps."""
    root, cute, source = pkg
    out = cute / cache.PREBUILT
    out.mkdir()
    for stale in ("fwd-sm_90a-bf16-d64-full-0123456789abcdef.json", "fwd-sm_90a-bf16-d64-full-0123456789abcdef.so",
                  "x.lock"):
        (out / stale).write_text("{}")
    env = dict(cache.environment(), **{"cute-runtime": ["cu99"]})
    (out / f"{OTHER_FLAVOUR}.json").write_text(json.dumps({"source": source, "env": env, "key": "f" * 64}))
    for ext in ("o", "so"):
        (out / f"{OTHER_FLAVOUR}.{ext}").write_bytes(b"other flavour")
    proc = subprocess.run([sys.executable, *_PRECOMPILE], cwd=root, env=_env(root), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bf16 d64 full  : compiled" in proc.stdout, proc.stdout
    assert str(out) in proc.stdout, proc.stdout
    return out


def _snapshot(folder):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_prebuilt_command_leaves_exactly_the_entries(shipped):
    _, key, name, symbol = kernels._entry(*CONFIG)
    assert sorted(p.name for p in shipped.iterdir()) == sorted(f"{stem}.{ext}" for ext in ("json", "o", "so")
                                                              for stem in (name, OTHER_FLAVOUR))
    manifest = json.loads((shipped / f"{name}.json").read_text())
    assert manifest["key"] == key and manifest["symbol"] == symbol and set(manifest["sha256"]) == {"o", "so"}
    assert manifest["source"] == cache.source_hash() and manifest["env"] == cache.environment()


_CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    from flash_attn.cute import cache, kernels

    def refuse(*args, **kwargs):
        raise AssertionError("compile_fwd called")

    kernels.compile_fwd = refuse
    t1 = time.perf_counter()
    fn = kernels.fwd_kernel(torch.bfloat16, 64, False, "sm_90a")
    t2 = time.perf_counter()
    q = torch.zeros(1, 128, 16, 64, dtype=torch.bfloat16)
    kernels._sm_counts[q.get_device()] = 132  # the persistent kernel's SM count, which a CPU tensor has none of
    try:  # the real kernel's TVM-FFI wrapper checks its arguments (on the CPU: the device type)
        fn(q, q, q, q, torch.zeros(1, 16, 128), 0.1, 0.0, 0, 0)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"origin": kernels._origins[(torch.bfloat16, 64, False, "sm_90a", False, False)],
                      "import_s": t1 - t0, "load_s": t2 - t1, "module": kernels.__file__,
                      "cutlass_imported": "cutlass" in sys.modules, "error": error}))
""")


def _run_child(user_cache, pythonpath):
    """The first lookup of a new process whose package is under ``pythonpath`` (its default shipped folder), with
    the empty user cache ``user_cache``."""
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=user_cache.parent, capture_output=True, text=True,
                          env=_env(pythonpath, FLASH_ATTN_CUTE_CACHE=str(user_cache)), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["module"].startswith(str(pythonpath)), result["module"]
    return result


def test_new_process_with_an_empty_cache_loads_the_shipped_entry(pkg, shipped, tmp_path):
    before = _snapshot(shipped)
    result = _run_child(tmp_path / "user", pkg[0])
    assert result["origin"] == "prebuilt-so"
    assert not result["cutlass_imported"], "loading a shipped entry must not import the CuTeDSL compiler"
    assert "expected device_type=cuda" in (result["error"] or ""), result["error"]
    assert _snapshot(shipped) == before  # nothing linked, locked or written there
    assert not (tmp_path / "user").exists()  # a hit writes nothing to the user's cache either
    print(f"\nnew process, shipped entry: lookup + load {result['load_s'] * 1e3:.1f} ms")


def test_user_cache_comes_first(shipped, tmp_path, cute_env, monkeypatch):
    user = tmp_path / "user"
    shutil.copytree(shipped, user)
    monkeypatch.setattr(cache, "PREBUILT_DIR", shipped)
    cute_env(CACHE=str(user))
    _, how = kernels.load_or_build(*CONFIG, root=cache.cache_dir())
    assert how == "so"


def test_object_only_shipped_entry_loads_without_writing_there(shipped, tmp_path, cute_env, monkeypatch):
    """A shipped entry without its shared library loads through CuTeDSL; the shipped folder is not a place to link
    one into (the user's own folder would be)."""
    _, _, name, _ = kernels._entry(*CONFIG)
    folder = shutil.copytree(shipped, tmp_path / "_prebuilt")
    (folder / f"{name}.so").unlink()
    manifest = json.loads((folder / f"{name}.json").read_text())
    del manifest["sha256"]["so"]
    (folder / f"{name}.json").write_text(json.dumps(manifest))
    before = _snapshot(folder)
    monkeypatch.setattr(cache, "PREBUILT_DIR", folder)
    cute_env(CACHE=str(tmp_path / "user"))
    monkeypatch.setattr(kernels, "compile_fwd", lambda *a, **k: pytest.fail("compile_fwd called"))
    fn, how = kernels.load_or_build(*CONFIG, root=cache.cache_dir())
    assert how == "prebuilt-o" and callable(fn)
    assert _snapshot(folder) == before


def test_explicit_folder_does_not_fall_back(shipped, tmp_path, monkeypatch):
    """precompile --out DIR and other named folders stand alone: only the runtime's own folder falls back."""
    _, key, name, _ = kernels._entry(*CONFIG)
    monkeypatch.setattr(cache, "PREBUILT_DIR", shipped)
    assert cache.DiskCache(tmp_path / "elsewhere").load(name, key) == (None, None)


class _Compiled(Exception):
    pass


def _other_env(monkeypatch):
    monkeypatch.setitem(cache._memo, "env", {**cache.environment(), "nvidia-cutlass-dsl": "0.0.0-other"})


def _edited_sources(monkeypatch):
    monkeypatch.setitem(cache._memo, ("source", str(cache._PKG_DIR)), "0" * 64)


def _foreign_manifest(monkeypatch, folder):
    # an entry of another key under the current entry's name (e.g. copied from another build)
    _, _, name, _ = kernels._entry(*CONFIG)
    manifest = json.loads((folder / f"{name}.json").read_text())
    manifest["key"] = "f" * 64
    (folder / f"{name}.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("change", [_other_env, _edited_sources, _foreign_manifest],
                         ids=["other-cutedsl-version", "edited-sources", "foreign-manifest"])
def test_shipped_entry_of_another_key_is_not_loaded(shipped, tmp_path, cute_env, monkeypatch, change):
    folder = shutil.copytree(shipped, tmp_path / "_prebuilt")
    monkeypatch.setattr(cache, "PREBUILT_DIR", folder)
    cute_env(CACHE=str(tmp_path / "user"))
    if change is _foreign_manifest:
        change(monkeypatch, folder)
    else:
        change(monkeypatch)
    _, key, name, _ = kernels._entry(*CONFIG)
    assert cache.DiskCache(cache.cache_dir()).load(name, key) == (None, None)

    def compiled(*args, **kwargs):
        raise _Compiled

    monkeypatch.setattr(kernels, "compile_fwd", compiled)
    with pytest.raises(_Compiled):  # the lookup misses, and the compile path is taken
        kernels.load_or_build(*CONFIG, root=cache.cache_dir())


def test_source_hash_leaves_the_shipped_folder_out(pkg, shipped, tmp_path, monkeypatch):
    _, cute, before = pkg  # hashed before the folder was filled
    copy = shutil.copytree(cute, tmp_path / "cute", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("__init__.py", "stray.py"):  # not even Python files there count
        (copy / cache.PREBUILT / name).write_text("anything")
    monkeypatch.setattr(cache, "_memo", {})
    assert cache.source_hash(cute) == before == cache.source_hash(copy)
    (copy / "stray.py").write_text("anything")  # a source file elsewhere does
    cache._memo.clear()
    assert cache.source_hash(copy) != before


def test_source_version_is_the_wheels():
    """A checkout (where the flash-attn-4 distribution may not be installed) keys entries with the version of
    the wheel it builds."""
    import re

    text = open(os.path.join(_PKG, "pyproject.toml")).read()
    assert cache.environment()["flash-attn-4"] == re.search(r'^version = "([^"]+)"', text, re.M).group(1)


@pytest.mark.slow
def test_wheel_packs_and_installed_package_loads_the_shipped_entries(pkg, shipped, tmp_path):
    """The wheel of packages/flash-attn-4 carries the git-ignored _prebuilt folder (hatch's artifacts), and the
    installed package (its source hash taken over the installed files) loads them from its default folder."""
    pytest.importorskip("hatchling")
    proj = shutil.copytree(pkg[0], tmp_path / "proj", ignore=shutil.ignore_patterns("__pycache__"))
    (proj / "flash_attn" / "cute" / cache.PREBUILT / "x.lock").write_text("")
    # as ignored as in the checkout, in a form hatch reads from the project's own folder
    (proj / ".gitignore").write_text(open(os.path.join(ROOT, ".gitignore")).read() + "\n_prebuilt/\n*.so\n*.o\n")
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "dist"), str(proj)], check=True, timeout=300)
    (whl,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(whl).namelist()
    packed = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("flash_attn/cute/_prebuilt/"))
    assert packed == sorted(p.name for p in shipped.iterdir())
    assert "flash_attn/__init__.py" not in names  # still a namespace portion
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install",
                    "--root-user-action=ignore", "--no-deps", "--target", str(tmp_path / "site"), str(whl)],
                   check=True, timeout=300)
    result = _run_child(tmp_path / "user", tmp_path / "site")
    assert result["origin"] == "prebuilt-so" and not result["cutlass_imported"]
    assert "expected device_type=cuda" in (result["error"] or ""), result["error"]
