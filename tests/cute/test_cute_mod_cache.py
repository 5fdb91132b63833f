"""The disk cache of the score_mod / mask_mod kernels (mods.disk_entry, plan rule mods_disk_cache) and the mod
functions' fingerprints it is keyed by (mod_fingerprint.py): what changes a fingerprint (source, closure values,
globals read, the functions called), what has none (then the kernel stays in memory only), and a kernel written to
the disk cache and loaded back by a process that has not compiled it (CPU: compiled for sm_90a, not run)."""
import json

import pytest
import torch

pytest.importorskip("cutlass")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from flash_attn.cute import mod_library as L  # noqa: E402
from flash_attn.cute import mods  # noqa: E402
from flash_attn.cute.mod_fingerprint import fingerprint  # noqa: E402

LIMIT = 7
SCALE_TABLE = torch.ones(3)


@cute.jit
def _limit_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return kv_idx[0] < q_idx[0] + cutlass.Int32(LIMIT)


@cute.jit
def _calls_helper(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return _limit_mask(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors)


@cute.jit
def _reads_a_tensor(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return score * cute.full_like(score, SCALE_TABLE.shape[0])


def test_fingerprint_follows_what_the_function_reads(monkeypatch):
    a = fingerprint(_limit_mask)
    assert a is not None and a == fingerprint(_limit_mask)
    json.dumps(a)  # (the disk key hashes it as JSON)
    assert a["globals"]["LIMIT"] == ["int", "7"] and a["globals"]["cutlass"] == ["module", "cutlass"]
    monkeypatch.setattr(__import__(__name__), "LIMIT", 8)
    assert fingerprint(_limit_mask) != a  # a global's value is part of the kernel
    b = fingerprint(_calls_helper)
    assert b["globals"]["_limit_mask"][0] == "fn"  # a called mod is described by its own fingerprint
    monkeypatch.setattr(__import__(__name__), "LIMIT", 9)
    assert fingerprint(_calls_helper) != b  # through the callee
    # closure constants: mod_library builds one function per window, each with its own values
    assert fingerprint(L.sliding_window(8, 0).mask_mod) != fingerprint(L.sliding_window(9, 0).mask_mod)
    assert fingerprint(L.sliding_window(8, 0).mask_mod) == fingerprint(L.sliding_window(8, 0).mask_mod)


def test_no_fingerprint_where_something_read_has_no_stable_description():
    assert fingerprint(_reads_a_tensor) is None  # a tensor global
    scope = {"cute": cute}
    exec("def f(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):\n    return kv_idx[0] <= q_idx[0]\n", scope)
    assert fingerprint(scope["f"]) is None  # no source

    import collections

    def reads_a_user_module(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return collections.OrderedDict  # (a module outside the versioned libraries)

    assert fingerprint(reads_a_user_module) is None


def test_disk_entry_only_under_the_plan_rule_and_with_fingerprints(cute_env):
    """An entry only with the rule (on by default) and a fingerprint of every mod."""
    facts = mods._facts(torch.bfloat16, 128, "sm_90a", ((torch.int32, 2),), causal=False, local=False, varlen=False,
                        sparse=(True, 1, 1), block_n=128, scalars=(), block_m=None, sink=False)
    cute_env(OVERRIDES="plan.mods_disk_cache=0")
    assert mods.disk_entry("mods-fwd", facts, None, _limit_mask) is None  # the rule off: memory only
    cute_env(OVERRIDES=None)  # on by default
    config, key, name, symbol = mods.disk_entry("mods-fwd", facts, None, _limit_mask)
    assert config["mask_mod"] == fingerprint(_limit_mask) and config["aux"] == [["int32", 2]]
    assert name.startswith("mods-fwd-sm_90a-bfloat16-d128-") and key[:16] in symbol
    assert mods.disk_entry("mods-fwd", facts, _reads_a_tensor, _limit_mask) is None  # memory only
    other = dict(facts, causal=True)
    assert mods.disk_entry("mods-fwd", other, None, _limit_mask)[1] != key
    # a kernel setting from the overrides (an A/B's variant) is part of the key: variants never share an entry
    cute_env(OVERRIDES="plan.mods_disk_cache=1,fwd.tiles_desc=0")
    variant = mods.disk_entry("mods-fwd", facts, None, _limit_mask)
    assert variant[1] != key and variant[0]["overrides"] == [("tiles_desc", False)]
    cute_env(OVERRIDES="plan.mods_disk_cache=1,bwd.stages=1")
    assert mods.disk_entry("mods-fwd", facts, None, _limit_mask)[1] == key  # (another kernel's section)
    assert mods.disk_entry("mods-bwd", facts, None, _limit_mask)[0]["overrides"] == [("stages", 1)]


def test_mod_kernel_is_written_and_loaded_back(cute_env, tmp_path, monkeypatch):
    """With the rule on, the first request compiles and writes the entry; a process that has the kernel in memory no
    more (the in-memory cache emptied) loads it from disk without compiling."""
    from flash_attn.cute import kernels

    monkeypatch.setattr(kernels, "_tvm_ffi", lambda: True)
    cute_env(OVERRIDES="plan.mods_disk_cache=1", CACHE=str(tmp_path))
    monkeypatch.setattr(mods, "_mod_kernels", type(mods._mod_kernels)())
    mask = L.sliding_window(16, 0).mask_mod
    fn = mods.mod_kernel(torch.bfloat16, 64, False, "sm_90a", False, False, None, mask, ())
    assert callable(fn)
    written = sorted(p.suffix for p in tmp_path.rglob("mods-fwd-*"))
    assert ".json" in written and ".o" in written, written
    monkeypatch.setattr(mods, "_mod_kernels", type(mods._mod_kernels)())
    monkeypatch.setattr(mods, "compile_fwd_mods", lambda *a, **k: pytest.fail("compiled instead of loading"))
    assert callable(mods.mod_kernel(torch.bfloat16, 64, False, "sm_90a", False, False, None, mask, ()))


def test_mod_backward_kernel_is_written_and_loaded_back(cute_env, tmp_path, monkeypatch):
    from flash_attn.cute import kernels

    monkeypatch.setattr(kernels, "_tvm_ffi", lambda: True)
    cute_env(OVERRIDES="plan.mods_disk_cache=1", CACHE=str(tmp_path))
    monkeypatch.setattr(mods, "_mod_bwd_kernels", type(mods._mod_bwd_kernels)())
    capped = L.softcap(20.0)
    args = (torch.bfloat16, 64, "sm_90a", None, ())
    kw = dict(score_mod=capped.score_mod, score_mod_bwd=capped.score_mod_bwd, causal=True)
    assert callable(mods.mod_bwd_kernel(*args, **kw))
    assert any(tmp_path.rglob("mods-bwd-*.json"))
    monkeypatch.setattr(mods, "_mod_bwd_kernels", type(mods._mod_bwd_kernels)())
    monkeypatch.setattr(kernels, "compile_bwd", lambda *a, **k: pytest.fail("compiled instead of loading"))
    assert callable(mods.mod_bwd_kernel(*args, **kw))


_WINDOW_8 = L.sliding_window(8, 0).mask_mod
_WINDOW_9 = L.sliding_window(9, 0).mask_mod


@cute.jit
def _uses_window_8(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
    return _WINDOW_8(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors)


def test_a_library_closure_a_mod_calls_is_described_by_its_values(monkeypatch):
    """A mod that calls a function mod_library built for one constant (a closure of a library module) is keyed by
    that function's values, not its name: the same name with another window is another kernel."""
    a = fingerprint(_uses_window_8)
    assert a is not None and a["globals"]["_WINDOW_8"][0] == "fn"
    monkeypatch.setattr(__import__(__name__), "_WINDOW_8", _WINDOW_9)
    assert fingerprint(_uses_window_8) != a


GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a Hopper (sm_90) GPU")
def test_mod_kernels_loaded_from_disk_run_on_the_gpu(tmp_path):
    """Two fresh processes with the rule on and one cache folder: the first compiles and writes the library mods'
    forward and backward kernels and runs them, the second must load every one from disk (its compile functions
    raise) and gets the same accuracy against fp32 PyTorch autograd."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, FLASH_ATTN_CUTE_OVERRIDES="plan.mods_disk_cache=1", FLASH_ATTN_CUTE_CACHE=str(tmp_path))
    script = os.path.join(os.path.dirname(__file__), "_mod_disk_run.py")
    runs = {}
    for phase in ("write", "load"):
        res = subprocess.run([sys.executable, script, phase], env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[phase] = json.loads(res.stdout.strip().splitlines()[-1])
    assert any(tmp_path.rglob("mods-fwd-*.json")) and any(tmp_path.rglob("mods-bwd-*.json"))
    for name, (out_err, dq_err) in runs["write"].items():
        assert out_err < 0.02 and dq_err < 0.1, (name, out_err, dq_err)
        loaded = runs["load"][name]
        assert loaded[0] == out_err, (name, loaded, out_err)  # the same forward kernel: the same bits
        assert loaded[1] <= 1.5 * dq_err + 1e-3, (name, loaded, dq_err)  # (dQ's adds arrive in any order)
