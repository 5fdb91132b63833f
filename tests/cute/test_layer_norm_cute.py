"""The CuTeDSL LayerNorm/RMSNorm backward for wide rows (flash_attn.cute.norm_bwd, the default;
FLASH_ATTN_DISABLE=ln_cute_bwd turns it off). CPU: which calls it serves, the switch, the threads table and the
variants (FLASH_ATTN_CUTE_OVERRIDES' ln.threads / ln.opts), the disk cache, and the sm_90a code it compiles to (PTX /
ptxas -v / SASS). GPU: values against the fp64 reference, judged against the Triton backward's own error, and bitwise
run-to-run equality, for the default and for every variant."""
import os
import re
import shutil
import subprocess

import pytest
import torch

from flash_attn.ops.triton import backend
from flash_attn.ops.triton import layer_norm as ln

cb = pytest.importorskip("flash_attn.cute.norm_bwd")  # (flash-attn-4 installed)
CUDA = torch.cuda.is_available()


def _call(M=8, N=16384, dtype=torch.bfloat16, wdtype=torch.float32, bias=True, dres=True, device="cpu", **over):
    """Keyword arguments of cb.plan for one backward call."""
    x = torch.empty(M, N, dtype=dtype, device=device)
    a = dict(x=x, weight=torch.empty(N, dtype=wdtype, device=device), weight1=None, dy=torch.empty_like(x),
             dy1=None, dresidual_out=torch.empty_like(x) if dres else None, rowscale=None, dropout_p=0.0,
             mean=torch.empty(M, device=device), rstd=torch.empty(M, device=device), dx=torch.empty_like(x),
             dx1=None, dresidual_in=torch.empty_like(x) if dres else None,
             db=torch.empty(N, dtype=wdtype, device=device) if bias else None, is_rms_norm=not bias,
             zero_centered_weight=False)
    a.update(over)
    return a


def test_finds_flash_attn_cute_runtime():
    """With flash-attn-4 and apache-tvm-ffi installed the kernel's disk-cache runtime is found: a lookup that fails
    (a moved helper in flash_attn.cute) would leave every call on Triton without a word."""
    import importlib.util

    pytest.importorskip("flash_attn.cute.kernels")
    cb._tvm_ffi_ok.cache_clear()
    assert cb._tvm_ffi_ok() is (importlib.util.find_spec("tvm_ffi") is not None)
    from flash_attn.cute.kernels import _load_or_build_entry  # what cb.kernel loads entries with

    assert callable(_load_or_build_entry)


def test_switch_defaults_on(fa_env):
    fa_env(DISABLE=None)
    assert ln.cute_bwd_enabled()
    for off in ("ln_cute_bwd", " LN_CUTE_BWD ", "ln_cute_bwd,"):
        fa_env(DISABLE=off)
        assert not ln.cute_bwd_enabled()
    fa_env(DISABLE="")
    assert ln.cute_bwd_enabled()
    with pytest.raises(ValueError, match="ln_cute_bwdx"):  # a misspelt feature never silently keeps it on
        fa_env(DISABLE="ln_cute_bwdx")


def test_served_calls(cute_env):
    cute_env(OVERRIDES=None)
    key = cb.plan(**_call(), check_device=False)
    assert key == ("bf16", "fp32", 16384, False, True, True, True, False, 512, ("p1", "p2"))  # OPTS_TABLE
    assert cb.plan(**_call(bias=False), check_device=False)[8] == 512  # RMSNorm 16384
    assert cb.plan(**_call(N=12288, bias=False, dres=False, zero_centered_weight=True), check_device=False) == \
        ("bf16", "fp32", 12288, True, False, False, False, True, 512, ())
    assert cb.plan(**_call(N=4096, dtype=torch.float16, wdtype=torch.float16), check_device=False)[:3] == \
        ("fp16", "fp16", 4096)
    for N in range(4096, 16385, 1024):
        assert cb.plan(**_call(N=N), check_device=False) is not None, N


def test_threads_table(cute_env):
    cute_env(OVERRIDES=None)
    assert cb.max_threads(16384, False) == 512 and cb.max_threads(16384, True) == 512
    assert cb.max_threads(12288, False) == 512 and cb.max_threads() == cb.MAX_THREADS == 512
    cute_env(OVERRIDES="ln.threads=1024")  # the override replaces the table
    assert cb.max_threads(16384, False) == 1024
    assert cb.plan(**_call(), check_device=False)[8] == 1024


def test_opts_table_is_the_default_and_the_override_replaces_it(cute_env):
    """LayerNorm 16384 runs p1+p2 by default (measured 0.872 of copy against 0.698); other keys none; a given
    ln.opts, even "none", replaces the table."""
    cute_env(OVERRIDES=None)
    assert cb.OPTS_TABLE == {(False, 16384): ("p1", "p2")}
    assert cb.plan(**_call(wdtype=torch.bfloat16), check_device=False)[8:] == (512, ("p1", "p2"))
    assert cb.plan(**_call(bias=False), check_device=False)[9] == ()  # RMSNorm 16384
    assert cb.plan(**_call(N=12288), check_device=False)[9] == ()
    cute_env(OVERRIDES="ln.opts=none")
    assert cb.plan(**_call(), check_device=False)[9] == ()
    cute_env(OVERRIDES="ln.opts=vld")
    assert cb.plan(**_call(), check_device=False)[9] == ("vld",)
    cute_env(OVERRIDES="fwd.stages=2")  # another section's override leaves the table in force
    assert cb.plan(**_call(), check_device=False)[9] == ("p1", "p2")


def test_options(cute_env):
    """ln.opts: known names only, in the key, sorted, and only where they change the code."""
    cute_env(OVERRIDES="ln.opts=p2+ w16+p1")
    assert cb.plan(**_call(wdtype=torch.bfloat16), check_device=False)[9] == ("w16", "p1", "p2")
    assert cb.plan(**_call(wdtype=torch.float32), check_device=False)[9] == ("p1", "p2")  # no 16-bit weight
    assert cb.plan(**_call(wdtype=torch.bfloat16, bias=False), check_device=False)[9] == ("w16",)  # RMSNorm
    assert cb.options(torch.float16, False, env="pp,vld,carve") == ("carve", "vld", "pp")
    assert cb.options(torch.float16, False, env="pp+vld+carve") == ("carve", "vld", "pp")
    assert cb.options("fp32", True, env="") == ()
    cute_env(OVERRIDES="ln.opts=w16+fast")
    with pytest.raises(ValueError, match="fast"):
        cb.plan(**_call(), check_device=False)


def test_carveout_and_w16_smem():
    """w16 keeps the weight in 2 bytes a column; carve asks for the shared memory the CTAs need (percent of
    228 KB, rounded up), else 100."""
    key = ("bf16", "bf16", 16384, False, True, False, False, False, 1024, ())
    assert cb.carveout(key) == 100
    assert cb.smem_bytes(16384, True, 1024) - cb.smem_bytes(16384, True, 1024, w16=True) == 16384 * 2
    need = cb.smem_bytes(16384, True, 1024) + 1024
    assert cb.carveout(key[:9] + (("carve",),)) == -(-100 * need // (228 * 1024)) == 85
    need16 = cb.smem_bytes(16384, True, 1024, w16=True) + 1024
    assert cb.carveout(key[:9] + (("w16", "carve"),)) == -(-100 * need16 // (228 * 1024)) == 71
    assert cb.grid(key, 10 ** 6, 132) == 132 and cb.grid(key, 5, 132) == 5


@pytest.mark.parametrize("what", ["dropout", "rowscale", "weight1", "fp32_x", "fp32_dres_in", "narrow", "wide",
                                  "odd", "strided", "mixed_dy"])
def test_not_served(what):
    a = _call()
    M, N = a["x"].shape
    if what == "dropout":
        a["dropout_p"] = 0.1
    elif what == "rowscale":
        a["rowscale"] = torch.ones(M)
    elif what == "weight1":
        a["weight1"] = torch.empty(N)
    elif what == "fp32_x":
        a = _call(dtype=torch.float32)
    elif what == "fp32_dres_in":
        a["dresidual_in"] = torch.empty(M, N)
    elif what == "narrow":
        a = _call(N=2048)
    elif what == "wide":
        a = _call(N=16384 + 1024)
    elif what == "odd":
        a = _call(N=4100)
    elif what == "strided":
        a["dy"] = torch.empty(M, 2 * N, dtype=torch.bfloat16)[:, :N:2]
    elif what == "mixed_dy":
        a["dy"] = torch.empty(M, N, dtype=torch.float16)
    assert cb.plan(**a, check_device=False) is None


def test_cpu_tensors_take_the_old_path(fa_env):
    """With the switch on, a CPU call is not served (no sm_90 device): _ln_bwd_cute declines and the
    default path's results are unchanged."""
    fa_env(DISABLE="")
    a = _call(M=2, N=4096)
    assert cb.plan(**a) is None
    args = (a["x"], a["weight"], None, a["dy"], None, a["dresidual_out"], None, None, a["mean"], a["rstd"], a["dx"],
            None, a["dresidual_in"], torch.empty(4096), a["db"], None, None, 0.0, False, False)
    assert ln._ln_bwd_cute(*args) is False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4096, generator=g, requires_grad=True)
    w = torch.randn(4096, generator=g, requires_grad=True)
    b = torch.randn(4096, generator=g, requires_grad=True)
    grads = []
    for disable in ("", "ln_cute_bwd"):
        fa_env(DISABLE=disable)
        with backend("torch"):
            y = ln.layer_norm_fn(x, w, b)
        grads.append(torch.autograd.grad(y.sum(), (x, w, b)))
    for p, q in zip(*grads):
        assert torch.equal(p, q)


def test_compile_failure_falls_back(cute_env, monkeypatch):
    """A key that does not compile warns once and returns None (the caller runs Triton), never retried."""
    pytest.importorskip("flash_attn.cute.interface")
    tries = []

    def broken(key, *a, **kw):
        tries.append(key)
        raise RuntimeError("no")

    monkeypatch.setattr(cb, "compile_kernel", broken)
    monkeypatch.setattr(cb, "_kernels", {})
    monkeypatch.setattr(cb, "_failed", {})
    cute_env(CACHE="off")
    key = ("bf16", "fp32", 4096, False, True, False, False, False, 512, ())
    with pytest.warns(UserWarning, match="using the Triton backward"):
        assert cb.kernel(key) is None
    assert cb.kernel(key) is None and tries == [key]


def test_threads_knob(cute_env):
    cute_env(OVERRIDES="ln.threads=1024")
    assert cb.plan(**_call(bias=False), check_device=False)[8] == 1024
    assert (cb.vectors(16384), cb.threads(16384)) == (2, 1024)
    cute_env(OVERRIDES="ln.threads=256")
    assert cb.plan(**_call(), check_device=False) is None  # 16384 would need 8 vectors a thread
    assert cb.plan(**_call(N=8192), check_device=False)[8] == 256
    cute_env(OVERRIDES="ln.threads=300")
    with pytest.raises(ValueError):
        cb.plan(**_call(), check_device=False)


def test_launch_shape():
    """Every configuration fits: threads a whole number of warps, shared memory within the SM, the
    per-SM CTA count at least one; 16384 takes 512 threads of 4 vectors."""
    for N in range(4096, 16385, 1024):
        K, T = cb.vectors(N), cb.threads(N)
        assert T * K * cb.VEC == N and T % 32 == 0 and T <= cb.MAX_THREADS
        for bias in (False, True):
            c = cb.ctas_per_sm(N, bias)
            assert c >= 1 and c * (cb.smem_bytes(N, bias) + 1024) <= cb.SMEM_PER_SM and c * T <= 2048
    assert (cb.vectors(16384), cb.threads(16384), cb.ctas_per_sm(16384, True)) == (4, 512, 1)
    assert cb.programs(3, 16384, True, 132) == 3 and cb.programs(10 ** 6, 16384, True, 132) == 132


def test_bench_script_parses():
    from benchmarks.ops import bench_ln_cute_bwd as mod

    a = mod.parse_args(["--hidden", "16384", "--residual", "--weight-dtype", "fp32"])
    assert a.hidden == "16384" and a.residual and a.weight_dtype == "fp32" and a.variants is None
    assert mod.variant_envs(None) == [("cute", {})]
    assert mod.variant_envs("512:;1024:w16+p1") == [
        ("cute t512 -", {"FLASH_ATTN_CUTE_OVERRIDES": "ln.threads=512"}),
        ("cute t1024 w16+p1", {"FLASH_ATTN_CUTE_OVERRIDES": "ln.threads=1024,ln.opts=w16+p1"})]
    assert mod.variant_envs(":pp") == [("cute ttable pp", {"FLASH_ATTN_CUTE_OVERRIDES": "ln.opts=pp"})]  # table threads
    # each path's environment: the caller's other settings kept, ln_cute_bwd off for Triton only, the variant's
    # overrides after the caller's (the later item wins)
    caller = {"FLASH_ATTN_DISABLE": "ln_cute_bwd", "FLASH_ATTN_CUTE_OVERRIDES": "fwd.stages=2,ln.threads=256"}
    assert mod.path_env(caller, False, {}) == {"FLASH_ATTN_DISABLE": "ln_cute_bwd",
                                               "FLASH_ATTN_CUTE_OVERRIDES": "fwd.stages=2,ln.threads=256"}
    assert mod.path_env(caller, True, mod.variant_envs("512:p1")[0][1]) == {
        "FLASH_ATTN_DISABLE": None,
        "FLASH_ATTN_CUTE_OVERRIDES": "fwd.stages=2,ln.threads=256,ln.threads=512,ln.opts=p1"}
    assert mod.path_env({}, True, {}) == {"FLASH_ATTN_DISABLE": None, "FLASH_ATTN_CUTE_OVERRIDES": None}


# ---------------------------------------------------------------------------------- disk cache
_CACHE_KEY = ("bf16", "bf16", 4096, True, False, False, False, False, 512, ())


def test_cache_entry_names():
    """Entries in flash_attn.cute's disk cache: a readable name ending in the key's first hex digits, a C
    symbol unique per key, a config naming every field of the compile key and this kernel's source."""
    import hashlib

    pytest.importorskip("flash_attn.cute.cache")
    config, ck, name, symbol = cb.cache_entry(_CACHE_KEY)
    assert name == f"lnbwd-sm_90a-bf16-wbf16-4096-rms-t512-{ck[:16]}" and symbol == f"flash_attn_lnbwd_{ck[:16]}"
    with open(cb.__file__, "rb") as f:
        assert config["source"] == hashlib.sha256(f.read()).hexdigest()
    assert config["kernel"] == "LnBwdSm90" and config["opts"] == [] and config["threads"] == 512
    others = [_CACHE_KEY[:8] + (1024, ()), _CACHE_KEY[:9] + (("w16", "pp"),), _CACHE_KEY[:3] + (False, True) +
              _CACHE_KEY[5:]]
    names = {name} | {cb.cache_entry(k)[2] for k in others}
    assert len(names) == 4 and any(n.startswith("lnbwd-sm_90a-bf16-wbf16-4096-rms-t512-w16-pp-") for n in names)
    assert cb.cache_entry(_CACHE_KEY, arch="sm_90")[1] != ck


@pytest.fixture(scope="module")
def filled_cache(tmp_path_factory):
    """A disk cache folder holding _CACHE_KEY's kernel, compiled (no GPU) and written by load_or_build."""
    pytest.importorskip("cutlass.cute")
    pytest.importorskip("tvm_ffi")
    root = tmp_path_factory.mktemp("lncache")
    old = os.environ.get("CUTE_DSL_ARCH")
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    try:
        fn, how = cb.load_or_build(_CACHE_KEY, root=root)
    finally:
        if old is None:
            os.environ.pop("CUTE_DSL_ARCH")
        else:
            os.environ["CUTE_DSL_ARCH"] = old
    assert how == "compiled" and callable(fn)
    return root


def _refuse_compile(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("compile_kernel called")

    monkeypatch.setattr(cb, "compile_kernel", refuse)


def test_disk_cache_second_load_hits_the_entry(filled_cache, cute_env, monkeypatch):
    from flash_attn.cute import cache

    _, ck, name, _ = cb.cache_entry(_CACHE_KEY)
    files = cache.DiskCache(filled_cache).files(name, ck)
    assert set(files) == ({"o", "so"} if cache._c_compiler() else {"o"})
    _refuse_compile(monkeypatch)
    fn, how = cb.load_or_build(_CACHE_KEY, root=filled_cache)
    assert how == ("so" if cache._c_compiler() else "o") and callable(fn)
    # kernel(): memory, then the folder of $FLASH_ATTN_CUTE_CACHE, loaded once
    cute_env(CACHE=str(filled_cache))
    for name_ in ("_kernels", "_origins", "_failed"):
        monkeypatch.setattr(cb, name_, {})
    loads, real_load = [], cache.DiskCache.load
    monkeypatch.setattr(cache.DiskCache, "load", lambda self, *a, **k: loads.append(a) or real_load(self, *a, **k))
    fn = cb.kernel(_CACHE_KEY)
    assert fn is not None and cb._origins[_CACHE_KEY] == how and cb.kernel(_CACHE_KEY) is fn and len(loads) == 1
    # another key (other threads) is another entry: not on disk, so it would compile (refused here: the
    # failure warns and falls back to Triton)
    with pytest.warns(UserWarning, match="using the Triton backward"):
        assert cb.kernel(_CACHE_KEY[:8] + (256, ())) is None


_CHILD = """
import json, sys
import torch
from flash_attn.cute import norm_bwd as cb

def refuse(*a, **k):
    raise AssertionError("compile_kernel called")

cb.compile_kernel = refuse
key = tuple(json.loads(sys.argv[1])[:9]) + ((),)
fn = cb.kernel(key)
t = torch.zeros(4, 4096, dtype=torch.bfloat16)
v = torch.zeros(4)
try:  # the real kernel's TVM-FFI wrapper checks its arguments (on the CPU: the device type)
    fn(t, t, torch.zeros(4096, dtype=torch.bfloat16), v, v, t, t, t, torch.zeros(1, 4096), torch.zeros(1, 4096), 1)
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
print(json.dumps({"origin": cb._origins.get(key), "cutlass_imported": "cutlass" in sys.modules, "error": error}))
"""


def test_new_process_loads_from_disk_without_compiling(filled_cache):
    """A new process loads the norm kernel from the disk cache: no compile, no import of the CuTeDSL
    compiler, and the loaded function checks its tensors' device."""
    import json
    import sys

    from flash_attn.cute import cache

    if not cache._c_compiler():
        pytest.skip("no C compiler: entries hold objects only, which load through CuTeDSL")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, FLASH_ATTN_CUTE_CACHE=str(filled_cache))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(list(_CACHE_KEY[:9]))], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["origin"] == "so"
    assert not result["cutlass_imported"], "loading from disk must not import the CuTeDSL compiler"
    assert "expected device_type=cuda" in (result["error"] or ""), result["error"]


# ---------------------------------------------------------------------------------- sm_90a code
# compile keys (dtype, weight dtype, N, is_rms, bias, dresidual_out, dresidual_in, zero-centred, threads, variants)
_CONFIGS = [("bf16", "fp32", 16384, False, True, True, True, False, 512, ()),
            ("bf16", "fp32", 16384, True, False, False, False, False, 512, ()),
            ("bf16", "fp32", 12288, False, True, True, True, False, 512, ()),
            ("bf16", "bf16", 8192, True, False, True, True, False, 512, ()),
            ("fp16", "fp16", 4096, False, True, False, False, True, 512, ()),
            ("bf16", "fp32", 16384, True, False, True, False, False, 1024, ()),
            ("bf16", "bf16", 16384, False, True, False, False, False, 1024, ()),  # the 1024-thread knob
            ("bf16", "bf16", 16384, False, True, False, False, False, 512, ("p1", "p2")),  # the default
            # ln.opts variants, where they are to be measured (LayerNorm 12288 / 16384)
            ("bf16", "bf16", 16384, False, True, False, False, False, 1024, ("w16", "carve")),
            ("bf16", "bf16", 16384, False, True, False, False, True, 512, ("w16",)),  # zero-centred 16-bit
            ("bf16", "bf16", 16384, False, True, False, False, False, 1024, ("p1", "p2")),
            ("bf16", "bf16", 12288, False, True, True, True, False, 512, ("vld",)),
            ("bf16", "bf16", 16384, False, True, False, False, False, 512, ("p1", "p2", "pp")),
            ("bf16", "bf16", 12288, True, False, False, False, False, 512, ("w16", "vld", "pp"))]


def _id(k):
    return (f"{k[0]}-w{k[1]}-{k[2]}-{'rms' if k[3] else 'ln'}{'-bias' if k[4] else ''}{'-dres' if k[5] else ''}"
            f"{'-zc' if k[7] else ''}-t{k[8]}{''.join('-' + o for o in k[9])}")


@pytest.fixture(scope="module", params=_CONFIGS, ids=_id)
def compiled(request, tmp_path_factory):
    pytest.importorskip("cutlass.cute")
    pytest.importorskip("tvm_ffi")
    key = request.param
    d = tmp_path_factory.mktemp("lncute")
    old = os.environ.get("CUTE_DSL_ARCH")
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    carveouts, real_carveout = [], cb.carveout
    cb.carveout = lambda k: carveouts.append(k) or real_carveout(k)
    try:
        cb.compile_kernel(key, dump_dir=str(d))
    finally:
        cb.carveout = real_carveout
        if old is None:
            os.environ.pop("CUTE_DSL_ARCH")
        else:
            os.environ["CUTE_DSL_ARCH"] = old
    assert carveouts == [key]  # the launch's carveout comes from the key (the carve variant)
    ptx = [p for p in d.iterdir() if p.suffix == ".ptx"]
    assert len(ptx) == 1
    return key, ptx[0]


def test_ptx_vector_loads_and_shared_accumulators(compiled):
    (_, wdt, N, rms, bias, dres, _, _, mt, opts), path = compiled
    ptx = path.read_text()
    K = cb.vectors(N, mt)
    rows = 2 if "pp" in opts else 1  # rows a loop iteration
    w16 = "w16" in opts
    assert f".reqntid {cb.threads(N, mt)}, 1, 1" in ptx
    body = ptx[ptx.index("bar.sync"):]  # the row loop from the row-sum barrier on
    # x, dy (and dresidual_out) of the next row as 16-byte loads before the barrier (vld: volatile, which
    # ptxas keeps in place); dx (and dresidual_in) as 16-byte stores after it
    ldg = r"ld\.volatile\.global\.v4\.b32" if "vld" in opts else r"ld\.global\.v4\.b32"
    assert len(re.findall(ldg, ptx)) >= (2 + dres) * K * rows
    assert len(re.findall(r"st\.global\.v4\.b32", body)) >= (1 + dres) * K * rows
    # dweight (and dbias) read-modify-write in shared memory, 2 float4 per vector each, plus the weight:
    # 2 float4 a vector, or (w16) one 16-byte load of 16-bit values
    n_acc = 1 + bias
    lds_f32 = len(re.findall(r"ld\.volatile\.shared\.v4\.f32", body))
    lds_b32 = len(re.findall(r"ld\.volatile\.shared\.v4\.b32", body))
    if w16:
        assert lds_f32 >= n_acc * 2 * K * rows and lds_b32 >= K * rows
    else:
        assert lds_f32 >= (n_acc + 1) * 2 * K * rows and lds_b32 == 0
    assert len(re.findall(r"st\.volatile\.shared\.v4\.f32", body)) >= n_acc * 2 * K * rows
    assert not re.search(r"\b(atom|red)\.", ptx)  # each thread owns its columns: no atomics
    assert ".local" not in ptx
    assert ptx.count("bar.sync") == rows  # one barrier per row


def test_ptx_vld_prefetches_mean_and_rstd(compiled):
    """vld loads mean and rstd (volatile) one row ahead; no other configuration has volatile global loads
    of single words. (w16, pp: test_ptx_vector_loads_and_shared_accumulators; p1, p2, vld's placement:
    test_sass_variants; carve: test_carveout_and_w16_smem.)"""
    (_, wdt, N, rms, bias, dres, _, zc, mt, opts), path = compiled
    ptx = path.read_text()
    assert (ptx.count("ld.volatile.global.f32") >= (1 if rms else 2)) == ("vld" in opts)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
def test_ptxas_registers_and_spills(compiled):
    (_, _, N, rms, bias, dres, _, _, mt, opts), path = compiled
    out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(path), "-o", os.devnull], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    regs = int(re.search(r"Used (\d+) registers", out.stderr).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", out.stderr).group(1))
    T = cb.threads(N, mt)
    assert regs * T * cb.ctas_per_sm(N, bias, mt, "w16" in opts) <= 65536, regs
    # 128 registers at 512 threads: ptxas parks a few loop-invariant words in local memory at 16384
    # (1024 threads has 64 registers and spills more: only the SASS bound below)
    if mt <= 512:
        assert spill <= 32, (spill, out.stderr)


def _sass_row_loop(path):
    from flash_attn.testing import cuobjdump_path

    tool = cuobjdump_path()
    if tool is None:
        pytest.skip("cuobjdump not available")
    cubin = [p for p in path.parent.iterdir() if p.suffix == ".cubin"]
    assert len(cubin) == 1
    sass = subprocess.run([tool, "-sass", str(cubin[0])], capture_output=True, text=True, timeout=300).stdout
    ins = []  # (address, opcode text)
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    assert loops, "no row loop found"
    lo, hi = max(loops, key=lambda r: r[1] - r[0])
    return [t for a, t in ins if lo <= a <= hi]


def test_sass_row_loop_local_memory(compiled):
    """Whatever ptxas spills stays out of the row loop but for a few words: at most 8 local loads/stores
    per row (L1 hits; 5 at 16384), against ~40 shared and ~10 global vector accesses per thread and row."""
    (_, _, N, rms, bias, dres, _, _, mt, opts), path = compiled
    body = _sass_row_loop(path)
    rows = 2 if "pp" in opts else 1
    assert sum("BAR.SYNC" in t for t in body) == rows
    # 1024 threads (64 registers): 22 measured at LayerNorm 16384 with dresidual, spilled row values
    bound = (8 if mt <= 512 else 32) * rows
    assert sum(bool(re.search(r"\b(LDL|STL)\b", t)) for t in body) <= bound, [t for t in body if "LDL" in t or "STL" in t]
    w_lds = 1 if "w16" in opts else 2  # 16-byte weight loads a vector
    assert sum("LDS.128" in t for t in body) >= cb.vectors(N, mt) * (2 * bias + 2 + w_lds) * rows


def test_sass_variants(compiled):
    """Where each variant shows in the row loop's SASS: vld's volatile global loads (LDG.E.128.STRONG.SYS)
    come before pass 1's first shared-memory load; p1 / p2 cut LayerNorm's fp32 adds / multiplies by one an
    element (benchmarks/tools/ln_cute_bwd_sass.py prints the counts)."""
    (_, _, N, rms, bias, dres, _, _, mt, opts), path = compiled
    body = _sass_row_loop(path)
    rows = 2 if "pp" in opts else 1
    elems = cb.VEC * cb.vectors(N, mt) * rows  # elements a thread per loop iteration
    if "vld" in opts:
        first_lds = next(i for i, t in enumerate(body) if "LDS.128" in t)
        strong = [i for i, t in enumerate(body) if "LDG.E.128.STRONG.SYS" in t]
        assert len(strong) >= 2 * cb.vectors(N, mt) * rows and strong[0] < first_lds
    fadd = sum(t.split()[0].startswith("FADD") for t in body)
    fmul = sum(t.split()[0].startswith("FMUL") for t in body)
    # LayerNorm, plain kernel (ptxas 13, sm_90a, measured): 3 FADD and 3 FMUL an element plus 20 FADD of
    # the row-sum butterflies and 3 FMUL a row; p1 takes one FADD an element away, p2 one FMUL
    if "p1" in opts:
        assert fadd <= 2 * elems + 24 * rows, (fadd, elems)
    if "p2" in opts:
        assert fmul <= 2 * elems + 8 * rows, (fmul, elems)


# ------------------------------------------------------------------------------------------ GPU
def _gpu_case(M, N, is_rms_norm, residual, seed=0, wdtype=torch.float32, x_mean=0.0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=g).to("cuda", dt)  # noqa: E731
    x = (x_mean + torch.randn(M, N, generator=g)).to("cuda", torch.bfloat16)
    w = (1 + 0.5 * torch.randn(N, generator=g)).to("cuda", wdtype)
    b = None if is_rms_norm else mk(N, dt=wdtype)
    res = mk(M, N) if residual else None
    return x, w, b, res


def _grads(x, w, b, res, is_rms_norm, dy, dres, cast=None, zc=False):
    xs = [t.detach().to(cast) if cast is not None and t is not None else
          (t.detach() if t is not None else None) for t in (x, w, b, res)]
    for t in xs:
        if t is not None:
            t.requires_grad_()
    fn = ln.rms_norm_fn if is_rms_norm else ln.layer_norm_fn
    if cast is None:
        out = fn(xs[0], xs[1], xs[2], residual=xs[3], prenorm=res is not None, zero_centered_weight=zc)
    else:
        ref = ln.rms_norm_ref if is_rms_norm else ln.layer_norm_ref
        out = ref(xs[0], xs[1], xs[2], residual=xs[3], prenorm=res is not None, upcast=False,
                  zero_centered_weight=zc)
    outs = list(out) if isinstance(out, tuple) else [out]
    gos = [dy] + ([dres] if res is not None else [])
    ins = [t for t in xs if t is not None]
    return torch.autograd.grad(outs, ins, [g.to(o.dtype) for g, o in zip(gos, outs)])


def _check_gpu(monkeypatch, fa_env, M, N, is_rms_norm, residual, wdtype=torch.float32, zc=False, disable="",
               x_mean=0.0):
    """dx, dweight, dbias, dresidual of the CuTeDSL path (FLASH_ATTN_DISABLE=disable, a value without
    ln_cute_bwd; None: unset, the default) against fp64, within 2x the Triton backward's own error
    (FLASH_ATTN_DISABLE=ln_cute_bwd) plus one bf16 rounding of the result; the CuTeDSL kernel must actually
    have been used, and two runs agree bitwise. Returns the compile key that served."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 only")
    x, w, b, res = _gpu_case(M, N, is_rms_norm, residual, seed=M + N, wdtype=wdtype, x_mean=x_mean)
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(M, N, generator=g).to("cuda", torch.bfloat16)
    dres = torch.randn(M, N, generator=g).to("cuda", torch.bfloat16) if residual else None
    fa_env(DISABLE="ln_cute_bwd")
    tri = _grads(x, w, b, res, is_rms_norm, dy, dres, zc=zc)
    fa_env(DISABLE=disable)
    calls, launch = [], cb.launch
    monkeypatch.setattr(cb, "launch", lambda *a: (calls.append(a[0]), launch(*a))[1])
    cute1 = _grads(x, w, b, res, is_rms_norm, dy, dres, zc=zc)
    cute2 = _grads(x, w, b, res, is_rms_norm, dy, dres, zc=zc)
    assert len(calls) == 2  # the CuTeDSL kernel served both backward calls
    ref = _grads(x, w, b, res, is_rms_norm, dy.double(), dres.double() if dres is not None else None,
                 cast=torch.float64, zc=zc)
    for i, (c1, c2, t, r) in enumerate(zip(cute1, cute2, tri, ref)):
        assert torch.equal(c1, c2), f"grad {i} not reproducible"
        assert c1.dtype == t.dtype and c1.shape == t.shape
        err_c = (c1.double() - r).abs().max().item()
        err_t = (t.double() - r).abs().max().item()
        rounding = r.abs().max().item() * (2.0 ** -8 if c1.dtype == torch.bfloat16 else 2.0 ** -23)
        assert err_c <= 2 * err_t + rounding, (i, err_c, err_t, rounding)
    return calls[0]


@pytest.mark.gpu
@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("N", [4096, 12288, 16384])
@pytest.mark.parametrize("M", [1, 3, 1000, 16384])
def test_gpu_matches_reference(monkeypatch, fa_env, cute_env, M, N, is_rms_norm, residual):
    """The default kernels (threads from THREADS_TABLE, variants from OPTS_TABLE) against fp64 (see
    _check_gpu)."""
    cute_env(OVERRIDES=None)
    key = _check_gpu(monkeypatch, fa_env, M, N, is_rms_norm, residual)
    assert key[8] == cb.THREADS_TABLE.get((is_rms_norm, N), cb.MAX_THREADS)
    assert key[9] == cb.OPTS_TABLE.get((is_rms_norm, N), ())


@pytest.mark.gpu
def test_gpu_on_by_default(monkeypatch, fa_env, cute_env):
    """With FLASH_ATTN_DISABLE unset the CuTeDSL kernel serves LayerNorm 16384 (512 threads, p1+p2)."""
    cute_env(OVERRIDES=None)
    key = _check_gpu(monkeypatch, fa_env, 300, 16384, False, False, disable=None)
    assert key[8:] == (512, ("p1", "p2"))


# (N, is_rms_norm, residual, zero-centred, threads): the shapes the variants are measured at, with the
# dresidual and zero-centred paths; bf16 weights so that w16 applies.
_VARIANT_CASES = [(12288, False, True, False, "512"), (16384, False, False, False, "1024"),
                  (16384, False, True, True, "512"), (16384, True, False, True, "512")]


@pytest.mark.gpu
@pytest.mark.parametrize("opts", ["w16", "carve", "p1", "p2", "vld", "pp", "w16+carve+p1+p2+vld+pp"])
@pytest.mark.parametrize("case", _VARIANT_CASES, ids=lambda c: f"{c[0]}-{'rms' if c[1] else 'ln'}"
                         f"{'-dres' if c[2] else ''}{'-zc' if c[3] else ''}-t{c[4]}")
@pytest.mark.parametrize("M", [3, 1001])  # 3: one row a CTA; 1001: 8 rows a CTA and a 1-row tail (pp's odd row)
def test_gpu_variants(monkeypatch, fa_env, cute_env, opts, case, M):
    """Every ln.opts variant, alone and all together, against fp64 (see _check_gpu)."""
    N, is_rms_norm, residual, zc, threads = case
    cute_env(OVERRIDES=f"ln.threads={threads},ln.opts={opts or 'none'}")
    key = _check_gpu(monkeypatch, fa_env, M, N, is_rms_norm, residual, wdtype=torch.bfloat16, zc=zc)
    assert key[9] == cb.options(torch.bfloat16, is_rms_norm, env=opts) and key[8] == int(threads)


@pytest.mark.gpu
@pytest.mark.parametrize("opts", ["", "p1"])
def test_gpu_large_mean(monkeypatch, fa_env, cute_env, opts):
    """x = 30 + N(0, 1): p1's sum(x * g) - mean * sum(g) cancels ~30x more than sum((x - mean) * g), in
    fp32, against dx's bf16 rounding (the Triton backward subtracts the mean first)."""
    cute_env(OVERRIDES=f"ln.opts={opts or 'none'}")
    key = _check_gpu(monkeypatch, fa_env, 1001, 16384, False, False, wdtype=torch.bfloat16, x_mean=30.0)
    assert key[9] == ((opts,) if opts else ())


@pytest.mark.gpu
def test_gpu_served_and_partials_rows(monkeypatch, fa_env):
    """Served calls run the CuTeDSL kernel, and a new row count reuses the compiled kernel (symbolic M)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 only")
    fa_env(DISABLE="")
    calls, launch = [], cb.launch
    monkeypatch.setattr(cb, "launch", lambda *a: (calls.append(a[0]), launch(*a))[1])
    for M in (5, 777):
        x, w, b, res = _gpu_case(M, 16384, False, False)
        dy = torch.randn(M, 16384, device="cuda", dtype=torch.bfloat16)
        _grads(x, w, b, res, False, dy, None)
    assert len(calls) == 2 and calls[0] == calls[1]
    assert calls[0] in cb._kernels and cb._origins[calls[0]] in ("so", "o", "compiled")
