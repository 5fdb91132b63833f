"""On-disk cache of compiled CuTeDSL kernels (the in-memory level is a dict in kernels.py).

An entry holds one kernel compiled with CuTeDSL's TVM-FFI calling convention, as CuTeDSL exports it
(``export_to_c``: a relocatable host object with the cubin inside) and, where a C compiler driver is
found, linked into a shared library. Loading the shared library needs only ``tvm_ffi`` and CuTeDSL's
small runtime library (``libcute_dsl_runtime.so``), not the CuTeDSL compiler: a new process that finds
its kernels here neither compiles nor imports ``cutlass`` (importing it alone takes about half a
second). Without the shared library the object file is loaded through ``cutlass.cute.runtime``.

Files of an entry ``NAME`` (the configuration in words plus the first hex digits of its key):
``NAME.o`` (the object), ``NAME.so`` (optional), ``NAME.json`` (format, full key, configuration,
exported symbol, SHA-256 of each binary; written last), ``NAME.lock`` (serialises writers).
Each file is written to a temporary name in the same folder and moved into place with ``os.replace``,
so a reader sees a whole file or none. Readers take no lock: they check the manifest's key and the
checksums, and anything that does not match (truncated, corrupt, another version's) is a miss, which
the caller rebuilds. Writers hold an exclusive ``flock`` on ``NAME.lock`` while they compile and
write, so concurrent processes compile one kernel once; the others wait and then load it.

The key is a SHA-256 over everything that changes the compiled code: the kernel configuration
(constructor arguments, architecture, compile options, calling convention), the SHA-256 of every
source file of the ``flash_attn.cute`` package, the versions of flash-attn-4, nvidia-cutlass-dsl and
apache-tvm-ffi, the CuTeDSL runtime flavour (CUDA 12 / 13) and the host CPU architecture (the object
holds host code). Batch, sequence lengths, head counts and strides are runtime values of the kernel.

Shipped entries: a wheel built after ``python -m flash_attn.cute.precompile --prebuilt`` carries the common
kernels in the package's ``_prebuilt`` folder (``PREBUILT_DIR``; git-ignored in the source tree). A lookup in the
user's cache (``cache_dir()``) that misses loads from there before anything compiles. That folder is read-only
at run time (nothing is linked, locked or written there) and its entries obey the same key: the source hash,
taken over the installed package's files less the ``_prebuilt`` folder, is the one the release job computed from
the same sources, and an entry of another CuTeDSL / TVM-FFI version or of edited sources is simply not found.
"""
import contextlib
import ctypes
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from flash_attn.cute import settings

ENV_VAR = settings.CACHE
FORMAT = 1  # bump when the files of an entry change meaning
_PKG_DIR = Path(__file__).resolve().parent
PREBUILT = "_prebuilt"
# The shipped read-only entries; None: none consulted (precompile builds without them; tests point it elsewhere).
PREBUILT_DIR = _PKG_DIR / PREBUILT
_memo = {}
_lock = threading.RLock()  # one in-process builder at a time; flock orders processes


def default_dir():
    base = settings.current.xdg_cache_home or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flash_attn_cute"


def cache_dir():
    """The disk cache folder: ``$FLASH_ATTN_CUTE_CACHE``, else ``$XDG_CACHE_HOME/flash_attn_cute``
    (``~/.cache/flash_attn_cute``); None when the variable is 0 / off / false / no / none."""
    value = settings.current.cache
    if settings.current.cache_off:
        return None
    return Path(value).expanduser() if value else default_dir()


def source_hash(root=None):
    """SHA-256 of the package's Python sources (relative paths and contents), the shipped entries' folder
    (``_prebuilt``, filled after the sources are final) left out."""
    root = Path(root) if root is not None else _PKG_DIR
    memo_key = ("source", str(root))
    if memo_key not in _memo:
        h = hashlib.sha256()
        for path in sorted(p for p in root.rglob("*.py")
                           if "__pycache__" not in p.parts and p.relative_to(root).parts[0] != PREBUILT):
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
        _memo[memo_key] = h.hexdigest()
    return _memo[memo_key]


def _cutlass_dsl_root():
    # A namespace package (no __init__): finding it imports nothing of the compiler.
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def _runtime_flavours():
    root = _cutlass_dsl_root()
    if root is None:
        return []
    return sorted(p.parent.parent.name for p in root.glob("*/lib/libcute_dsl_runtime.so"))


def _source_version():
    """flash-attn-4's version from the pyproject.toml beside these sources (a source checkout), else None."""
    import re

    try:
        text = (_PKG_DIR.parent.parent / "pyproject.toml").read_text()
    except OSError:
        return None
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if project is None or not re.search(r'^name\s*=\s*"flash-attn-4"', project.group(1), re.M):
        return None
    found = re.search(r'^version\s*=\s*"([^"]+)"', project.group(1), re.M)
    return found.group(1) if found else None


def environment():
    """What besides the sources and the configuration changes the compiled code."""
    if "env" not in _memo:
        from importlib import metadata

        def version(dist):
            try:
                return metadata.version(dist)
            except Exception:  # not installed (a source checkout), or unreadable metadata
                return None

        _memo["env"] = {
            # The sources' own version first: a checkout that precompiles the shipped entries (where the
            # flash-attn-4 distribution may not be installed) keys them as the wheel built from it.
            "flash-attn-4": _source_version() or version("flash-attn-4"),
            "nvidia-cutlass-dsl": version("nvidia-cutlass-dsl"),
            "apache-tvm-ffi": version("apache-tvm-ffi"),
            "cute-runtime": _runtime_flavours(),
            "host": f"{sys.platform}-{platform.machine()}",
        }
    return _memo["env"]


def entry_key(config):
    """Full hex key of a configuration (a JSON-able dict)."""
    blob = json.dumps({"format": FORMAT, "config": config, "source": source_hash(), "env": environment()},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _tmp_path(path, suffix):
    # Same folder (os.replace must not cross file systems); the suffix keeps the extension that
    # CuTeDSL's export reads the output format from.
    return path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp{suffix}"


@contextlib.contextmanager
def _temporary(path, suffix):
    tmp = _tmp_path(path, suffix)
    try:
        yield tmp
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _write_atomic(path, data):
    with _temporary(path, path.suffix) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def _c_compiler():
    for name in (settings.current.cc, "cc", "gcc", "clang"):
        if name:
            found = shutil.which(name)
            if found:
                return found
    return None


def _link_shared(obj, out):
    """Link CuTeDSL's exported object into a shared library. Its runtime symbols (CuTeDSL's runtime
    library, TVM-FFI) stay undefined: they resolve against the copies loaded RTLD_GLOBAL before the
    library is opened, wherever the Python packages live. ``-z now`` makes a missing symbol fail the
    load (an error the caller handles) instead of aborting the process at the first call."""
    cc = _c_compiler()
    if cc is None:
        return False
    with _temporary(out, ".so") as tmp:
        try:
            proc = subprocess.run([cc, "-shared", "-Wl,-z,now", "-o", str(tmp), str(obj)],
                                  capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            _note(f"linking {obj.name} failed ({cc}): {e}")
            return False
        if proc.returncode != 0 or not tmp.exists():
            _note(f"linking {obj.name} failed ({cc}): {proc.stderr.strip()[:500]}")
            return False
        os.replace(tmp, out)
    return True


def _runtime_library():
    """Path of CuTeDSL's runtime library, found without importing cutlass: ``CUTE_DSL_LIBS`` as
    CuTeDSL reads it, else the single flavour under the nvidia_cutlass_dsl package."""
    for path in settings.current.cute_dsl_libs.split(os.pathsep):
        if path.endswith("libcute_dsl_runtime.so") and os.path.exists(path):
            return path
    root = _cutlass_dsl_root()
    found = sorted(root.glob("*/lib/libcute_dsl_runtime.so")) if root is not None else []
    return str(found[0]) if len(found) == 1 else None


def _preload_runtime():
    if "runtime" not in _memo:
        import importlib

        importlib.import_module("tvm_ffi")  # loads libtvm_ffi RTLD_GLOBAL, for the library's TVM-FFI symbols
        path = _runtime_library()
        _memo["runtime"] = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL) if path else None
    return _memo["runtime"] is not None


def _load_shared(path, symbol):
    import tvm_ffi

    fn = tvm_ffi.load_module(str(path)).get_function(symbol)
    if fn is None:
        raise RuntimeError(f"{symbol} not in {path}")
    return fn


def _load_object(path, symbol):
    from cutlass.cute.runtime import load_module

    return load_module(str(path), enable_tvm_ffi=True)[symbol]


_notes = []


def _note(message):
    """Cache problems never fail a call: they are remembered (``notes()``) and, with
    FLASH_ATTN_CUTE_CACHE_VERBOSE=1, printed to stderr."""
    _notes.append(message)
    del _notes[:-100]
    if settings.current.cache_verbose:
        print(f"flash_attn.cute cache: {message}", file=sys.stderr)


def notes():
    return list(_notes)


def prebuilt():
    """The shipped entries (``PREBUILT_DIR``) as a read-only DiskCache, or None when there are none."""
    root = PREBUILT_DIR
    return DiskCache(root, readonly=True) if root is not None and Path(root).is_dir() else None


class DiskCache:
    """The entries of one folder. ``load`` and ``store`` never raise for a bad or unwritable
    entry: a failed load is a miss, a failed store leaves the caller's compiled kernel in use.
    ``readonly``: ``load`` never writes there (no shared library is linked in place), as for the
    shipped entries."""

    def __init__(self, root, readonly=False):
        self.root = Path(root)
        self.readonly = readonly

    def _falls_back(self):
        # The runtime's own folder (kernels pass cache_dir()) falls back to the shipped entries; a folder named
        # explicitly (precompile --out, tests) stands alone.
        if self.readonly or PREBUILT_DIR is None:
            return False
        own = cache_dir()
        try:
            return own is not None and self.root.resolve() == Path(own).resolve() != Path(PREBUILT_DIR).resolve()
        except OSError:
            return False

    def paths(self, name):
        return {ext: self.root / f"{name}.{ext}" for ext in ("o", "so", "json", "lock")}

    def _manifest(self, name, key):
        path = self.paths(name)["json"]
        try:
            manifest = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            _note(f"unreadable manifest {path}: {e}")
            return None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("key") != key:
            _note(f"stale or foreign manifest {path}")
            return None
        return manifest

    def _intact(self, manifest, path, ext):
        want = manifest.get("sha256", {}).get(ext)
        try:
            return want is not None and _sha256(path) == want
        except OSError:
            return False

    def files(self, name, key):
        """The entry's intact binaries {"o": path, "so": path} (either may be absent); {} when there is
        no valid entry. Loads nothing."""
        manifest = self._manifest(name, key)
        if manifest is None:
            return {}
        paths = self.paths(name)
        return {ext: paths[ext] for ext in ("o", "so") if self._intact(manifest, paths[ext], ext)}

    def load(self, name, key, locked=False):
        """(callable, how) with how in ("so", "o"), or (None, None) on a miss. ``locked``: the caller
        holds ``writer(name)`` (flock is per open file: taking it again here would wait forever). A miss
        in the runtime's folder (``cache_dir()``) is looked up in the shipped entries (``prebuilt()``),
        how then "prebuilt-so" / "prebuilt-o"."""
        fn, how = self._load(name, key, locked)
        if fn is None and self._falls_back():
            shipped = prebuilt()
            if shipped is not None:
                fn, how = shipped._load(name, key, False)
                how = how and f"prebuilt-{how}"
        return fn, how

    def _load(self, name, key, locked):
        manifest = self._manifest(name, key)
        if manifest is None:
            return None, None
        symbol, paths = manifest.get("symbol"), self.paths(name)
        if not isinstance(symbol, str):
            return None, None
        so_ok = self._intact(manifest, paths["so"], "so")
        if not so_ok and not self.readonly and self._intact(manifest, paths["o"], "o"):
            # An entry from a machine without a C compiler: link it here, once, for later processes.
            so_ok = self._add_shared(name, key, paths, locked)
            manifest = self._manifest(name, key) or manifest
        try:
            if so_ok and _preload_runtime():
                return _load_shared(paths["so"], symbol), "so"
        except Exception as e:  # a library that does not load is a miss, not an error
            _note(f"loading {paths['so']} failed: {e}")
        if self._intact(manifest, paths["o"], "o"):
            try:
                return _load_object(paths["o"], symbol), "o"
            except Exception as e:
                _note(f"loading {paths['o']} failed: {e}")
        return None, None

    def _add_shared(self, name, key, paths, locked):
        try:
            with (contextlib.nullcontext() if locked else self.writer(name)):
                manifest = self._manifest(name, key)
                if manifest is None or not self._intact(manifest, paths["o"], "o"):
                    return False
                if self._intact(manifest, paths["so"], "so"):
                    return True  # another process linked it meanwhile
                if not _link_shared(paths["o"], paths["so"]):
                    return False
                manifest["sha256"]["so"] = _sha256(paths["so"])
                _write_atomic(paths["json"], json.dumps(manifest, indent=1, sort_keys=True).encode())
                return True
        except OSError as e:  # a folder this process cannot write
            _note(f"cannot add {paths['so']}: {e}")
            return False

    @contextlib.contextmanager
    def writer(self, name):
        """Exclusive per-entry lock across processes (flock; released if the holder dies). Raises
        OSError when the folder cannot be written."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # not POSIX: writes stay atomic, concurrent builders may both compile
            yield
            return
        with open(self.paths(name)["lock"], "a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _sweep(self, name, max_age_s=3600.0):
        # Temporary files of writers that died mid-write (their names carry the entry's name).
        now = time.time()
        for tmp in self.root.glob(f".{name}.*.tmp*"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > max_age_s:
                    tmp.unlink()

    def store(self, name, key, symbol, export, info):
        """Write an entry: ``export(path)`` writes CuTeDSL's object file (its name ends in .o). Call
        under ``writer(name)``. Returns True when the entry is complete on disk."""
        paths = self.paths(name)
        self._sweep(name)
        try:
            with _temporary(paths["o"], ".o") as tmp:
                export(str(tmp))
                digest = {"o": _sha256(tmp)}
                os.replace(tmp, paths["o"])
            if _link_shared(paths["o"], paths["so"]):
                digest["so"] = _sha256(paths["so"])
            manifest = {"format": FORMAT, "key": key, "symbol": symbol, "sha256": digest, **info}
            _write_atomic(paths["json"], json.dumps(manifest, indent=1, sort_keys=True).encode())
            return True
        except Exception as e:  # read-only folder, full disk, export failure: keep the kernel in memory
            _note(f"cannot write {paths['o']}: {type(e).__name__}: {e}")
            return False
