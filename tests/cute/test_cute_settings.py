"""flash_attn.cute's settings (settings.py) and overrides (config.overrides): FLASH_ATTN_CUTE_OVERRIDES replaces fields
of the typed configurations and refuses what it does not know, FLASH_ATTN_CUTE_DISABLE switches kernel features off
(each with its effect), the environment is read once (settings.reload() reads it again), and no other module of the package
reads an environment variable. Host-side only: no kernel is compiled here."""
import glob
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import backend, cache, config, kernels, plan, settings  # noqa: E402

BF16 = torch.bfloat16


def _call(**kw):
    from flash_attn.dispatch import Call

    base = dict(device_type="cuda", dtype=BF16, head_dim=128, head_dim_v=128, arch=(9, 0))
    base.update(kw)
    return Call(**base)


# ----------------------------------------------------------------------------------------------------
# FLASH_ATTN_CUTE_OVERRIDES: what it refuses


@pytest.mark.parametrize("text,names", [
    ("fwd.no_such_field=1", ["fwd.no_such_field"]),  # unknown field
    ("bwd.warpgroups=3", ["bwd.warpgroups"]),  # a field of another section
    ("no_such_field=1", ["no_such_field"]),  # a bare name no section has
    ("gpu.stages=2", ["'gpu'", "unknown section"]),  # unknown section
    ("fwd.stages=two", ["fwd.stages", "'two'", "int"]),  # wrong type: int
    ("fwd.block_n=1.5", ["fwd.block_n", "int"]),
    ("fwd.pin=maybe", ["fwd.pin", "bool"]),  # wrong type: bool
    ("stages=x", ["stages", "int"]),  # a bare name: checked in each section that has it
    ("fwd.causal=1", ["fwd.causal", "not a tunable field"]),  # what the call decides is not tunable
    ("head_dim=64", ["head_dim", "not a tunable field"]),
])
def test_overrides_refuse_unknown_and_mistyped_fields(cute_env, text, names):
    cute_env(OVERRIDES=text)  # checked when a configuration is selected
    for select in (lambda: kernels.fwd_config(BF16, 128, True), lambda: kernels.bwd_config(BF16, 128, True),
                   config.plan_rules):
        with pytest.raises(ValueError, match=settings.OVERRIDES) as err:
            select()
        for name in names:
            assert name in str(err.value), (name, str(err.value))


@pytest.mark.parametrize("text", ["fwd.stages", "fwd.stages=", "=2", "fwd.stages=2,,pin"])
def test_overrides_refuse_malformed_items_when_read(cute_env, text):
    with pytest.raises(ValueError, match=f"{settings.OVERRIDES}.*is not \\[section.\\]field=value"):
        cute_env(OVERRIDES=text)


def test_plan_rules_refuse_an_unknown_backward_host(cute_env):
    cute_env(OVERRIDES="plan.bwd_host=cuda")
    with pytest.raises(ValueError, match="FLASH_ATTN_CUTE_OVERRIDES: plan.bwd_host='cuda'"):
        config.plan_rules()


@pytest.mark.parametrize("text,unknown", [("nope", "nope"), ("bwd,fwd", "fwd"), ("256", "256"), ("d64", "d64"),
                                          ("paged=0", "paged=0")])
def test_disable_refuses_unknown_features(cute_env, text, unknown):
    with pytest.raises(ValueError, match=settings.DISABLE) as err:
        cute_env(DISABLE=text)
    assert repr(unknown) in str(err.value) and "expected some of" in str(err.value)


def test_disable_names_are_a_comma_separated_set(cute_env):
    assert cute_env(DISABLE=" Bwd , paged,,split ").disabled == frozenset({"bwd", "paged", "split"})
    assert settings.disabled("bwd") and settings.disabled("paged") and not settings.disabled("d256")
    assert cute_env(DISABLE=None).disabled == frozenset()
    assert not any(settings.disabled(f) for f in settings.FEATURES)


# ----------------------------------------------------------------------------------------------------
# FLASH_ATTN_CUTE_OVERRIDES: what it sets


def test_a_bare_field_sets_every_section_that_has_it(cute_env):
    fwd0, bwd0 = kernels.fwd_config(BF16, 128, True), kernels.bwd_config(BF16, 128, True)
    assert (fwd0.stages, bwd0.stages) == (3, 2)
    cute_env(OVERRIDES="stages=4")
    assert kernels.fwd_config(BF16, 128, True).stages == 4 and kernels.bwd_config(BF16, 128, True).stages == 4
    cute_env(OVERRIDES="exp2_emu=6")  # fwd and bwd both have it
    assert kernels.fwd_config(BF16, 128, True).exp2_emu == 6 and kernels.bwd_config(BF16, 128, True).exp2_emu == 6
    cute_env(OVERRIDES="block_m=128")  # the backward's only
    assert kernels.bwd_config(BF16, 128, True).block_m == 128
    assert kernels.fwd_config(BF16, 128, True) == fwd0
    cute_env(OVERRIDES="block_n=64")  # the forward's only
    assert kernels.fwd_config(BF16, 128, True).block_n == 64 and kernels.bwd_config(BF16, 128, True) == bwd0
    cute_env(OVERRIDES="bwd_host=torch")  # the plan's only
    assert config.plan_rules().bwd_host == "torch"
    cute_env(OVERRIDES="fwd.stages=4")  # a section: that section only
    assert kernels.fwd_config(BF16, 128, True).stages == 4 and kernels.bwd_config(BF16, 128, True) == bwd0
    cute_env(OVERRIDES="bwd.stages=3,fwd.stages=2")
    assert kernels.fwd_config(BF16, 128, True).stages == 2 and kernels.bwd_config(BF16, 128, True).stages == 3


def test_override_values_are_typed(cute_env):
    for raw, value in (("0", False), ("false", False), ("False", False), ("1", True), ("true", True)):
        cute_env(OVERRIDES=f"fwd.pin={raw}")
        assert kernels.fwd_config(BF16, 128, True).pin is value
    cute_env(OVERRIDES="fwd.stages= 2 ,bwd.lpt=16")  # spaces around values
    assert kernels.fwd_config(BF16, 128, True).stages == 2 and kernels.bwd_config(BF16, 64, True).lpt == 16


def test_overrides_change_the_disk_cache_key(cute_env):
    fwd = kernels.fwd_config(BF16, 128, True)
    bwd = kernels.bwd_config(BF16, 64, True)
    fwd_key, bwd_key = cache.entry_key(fwd.key()), cache.entry_key(bwd.key())
    fwd_entry, bwd_entry = kernels._entry(BF16, 128, True, "sm_90a"), kernels._bwd_entry(BF16, 64, True, "sm_90a")
    assert fwd_entry[1] == fwd_key and bwd_entry[1] == bwd_key
    cute_env(OVERRIDES="fwd.block_n=64,bwd.stages=3")
    fwd2, bwd2 = kernels.fwd_config(BF16, 128, True), kernels.bwd_config(BF16, 64, True)
    assert fwd2.key() == {**fwd.key(), "block_n": 64} and bwd2.key() == {**bwd.key(), "stages": 3}
    assert cache.entry_key(fwd2.key()) != fwd_key and cache.entry_key(bwd2.key()) != bwd_key
    assert kernels._entry(BF16, 128, True, "sm_90a")[1] == cache.entry_key(fwd2.key()) != fwd_key
    assert kernels._bwd_entry(BF16, 64, True, "sm_90a")[1] == cache.entry_key(bwd2.key()) != bwd_key
    # an override that gives the default value changes nothing: the default kernels keep their entries
    cute_env(OVERRIDES=f"fwd.block_n={fwd.block_n},fwd.stages={fwd.stages},bwd.stages={bwd.stages}")
    assert kernels._entry(BF16, 128, True, "sm_90a")[1] == fwd_key
    assert kernels._bwd_entry(BF16, 64, True, "sm_90a")[1] == bwd_key
    cute_env(OVERRIDES=None)
    assert kernels._entry(BF16, 128, True, "sm_90a")[1] == fwd_key


def test_the_environment_is_read_once_and_again_on_reload(cute_env, monkeypatch):
    base = kernels.fwd_config(BF16, 128, True)
    monkeypatch.setenv(settings.OVERRIDES, "fwd.stages=2")
    monkeypatch.setenv(settings.DISABLE, "split")
    assert kernels.fwd_config(BF16, 128, True) == base and not settings.disabled("split")  # not read yet
    assert plan._split_count(4) == 4
    current = settings.reload()
    assert current is settings.current and current.overrides == {"fwd": {"stages": "2"}}
    assert kernels.fwd_config(BF16, 128, True).stages == 2 and settings.disabled("split")
    assert plan._split_count(4) == 1
    monkeypatch.setenv(settings.OVERRIDES, "fwd.stages=4")
    monkeypatch.delenv(settings.DISABLE)
    settings.reload()
    assert kernels.fwd_config(BF16, 128, True).stages == 4 and plan._split_count(4) == 4
    monkeypatch.setenv(settings.OVERRIDES, "plan.pack_gqa_auto=1")
    assert not config.plan_rules().pack_gqa_auto
    settings.reload()
    assert config.plan_rules().pack_gqa_auto


# ----------------------------------------------------------------------------------------------------
# FLASH_ATTN_CUTE_DISABLE: each feature's effect


def test_disable_bwd_refuses_backward_calls_only(cute_env):
    from flash_attn.cute import autograd

    call = _call(head_dim=64, head_dim_v=64, causal=True, backward=True)
    assert backend.unsupported_reason(call) is None
    q = torch.zeros(1, 8, 2, 64)
    U = plan._UNBOUNDED
    assert autograd._kernel_takes(q, q, True, U, U, 0.0, False, None)
    cute_env(DISABLE="bwd")
    why = backend.unsupported_reason(call)
    assert why is not None and settings.DISABLE in why and "bwd" in why, why
    assert not autograd._kernel_takes(q, q, True, U, U, 0.0, False, None)  # the package's own autograd too
    assert backend.unsupported_reason(call._replace(backward=False)) is None  # forward calls are untouched


@pytest.mark.parametrize("names,left", [("d96", (64, 128, 192, 256)), ("d192", (64, 96, 128, 256)),
                                        ("d256", (64, 96, 128, 192)), ("d96,d192", (64, 128, 256)),
                                        ("d96,d192,d256", (64, 128))])
def test_disable_head_dims_leaves_the_others(cute_env, names, left):
    assert backend.forward_head_dims() == (64, 96, 128, 192, 256)
    cute_env(DISABLE=names)
    assert backend.forward_head_dims() == left
    for d in (96, 192, 256):
        why = backend.unsupported_reason(_call(head_dim=d, head_dim_v=d))
        if d in left:
            assert why is None, why
        else:
            assert why is not None and settings.DISABLE in why and f"d{d}" in why, why
    for d in (64, 128):  # always served
        assert backend.unsupported_reason(_call(head_dim=d, head_dim_v=d)) is None
        assert backend.unsupported_reason(_call(head_dim=d, head_dim_v=d, backward=True)) is None


@pytest.mark.parametrize("names", ["d96", "d96,d256", "d192,d256"])
def test_disable_d96_refuses_its_backward_too(cute_env, names):
    """FLASH_ATTN_CUTE_DISABLE=d96 sends d96's backward on as well, in the dispatcher and in flash_attn.cute's own
    autograd; naming other head dims leaves it served and takes theirs (d192 / d256) off the backward kernel."""
    from flash_attn.cute import autograd

    q = torch.zeros(1, 8, 2, 96)
    U = plan._UNBOUNDED
    call = _call(head_dim=96, head_dim_v=96, causal=True, backward=True)
    assert backend.backward_head_dims() == (64, 96, 128, 192, 256)
    assert backend.unsupported_reason(call) is None and autograd._kernel_takes(q, q, True, U, U, 0.0, False, None)
    cute_env(DISABLE=names)
    off = "d96" in names.split(",")
    named = {int(n[1:]) for n in names.split(",")}
    assert backend.backward_head_dims() == tuple(d for d in (64, 96, 128, 192, 256) if d not in named)
    why = backend.unsupported_reason(call)
    if off:
        assert why is not None and settings.DISABLE in why and "d96" in why, why
    else:
        assert why is None, why
    assert autograd._kernel_takes(q, q, True, U, U, 0.0, False, None) is not off
    for d in (64, 128):
        k = torch.zeros(1, 8, 2, d)
        assert autograd._kernel_takes(k, k, True, U, U, 0.0, False, None)


def test_disable_pack_gqa_runs_calls_unpacked(cute_env):
    assert plan._pack_group(True, 8, 2) == 4 and plan._pack_group(True, 32, 2, 1) == 16
    cute_env(DISABLE="pack_gqa")
    assert plan._pack_group(True, 8, 2) == 1 and plan._pack_group(True, 32, 2, 1) == 1


def test_disable_split_runs_calls_unsplit(cute_env):
    assert plan._split_count(4) == 4 and plan._split_count(8, seqlen_k=1024) == 8
    assert plan._split_count(8, seqlen_k=300) == 3  # at most one part per 128-key block
    cute_env(DISABLE="split")
    assert plan._split_count(4) == 1 and plan._split_count(8, seqlen_k=1024) == 1
    with pytest.raises(ValueError, match="num_splits must be an int"):  # the argument is still checked
        plan._split_count(2.5)


def _paged_args():
    q = torch.zeros(7, 4, 64, dtype=BF16)
    k = v = torch.zeros(2, 16, 2, 64, dtype=BF16)  # 2 pages of 16 rows
    return q, k, v, dict(cu_seqlens_q=torch.tensor([0, 7], dtype=torch.int32),
                         seqused_k=torch.tensor([20], dtype=torch.int32),
                         page_table=torch.tensor([[1, 0]], dtype=torch.int32))


def test_disable_paged_refuses_paged_calls(cute_env):
    from flash_attn.cute import flash_attn_varlen_func

    q, k, v, kw = _paged_args()
    assert backend.unsupported_reason(_call(varlen=True, paged=True)) is None
    with pytest.raises(ValueError, match="CUDA tensors"):  # on: refused only at the device check (CPU tensors)
        flash_attn_varlen_func(q, k, v, **kw)
    cute_env(DISABLE="paged")
    with pytest.raises(NotImplementedError, match="page_table"):
        flash_attn_varlen_func(q, k, v, **kw)
    why = backend.unsupported_reason(_call(varlen=True, paged=True))
    assert why is not None and settings.DISABLE in why and "paged" in why, why
    # unpaged varlen calls are untouched
    cu = torch.tensor([0, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_attn_varlen_func(q, q[:, :2], q[:, :2], cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert backend.unsupported_reason(_call(varlen=True)) is None


def test_disable_hdim_v_refuses_unequal_head_dims(cute_env):
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func, interface

    q = torch.zeros(2, 7, 4, 192, dtype=BF16)
    k = torch.zeros(2, 7, 2, 192, dtype=BF16)
    v = torch.zeros(2, 7, 2, 128, dtype=BF16)
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)
    packed = (q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1))
    interface._check_dims(192, 128, 4, 2)  # (192, 128): one of config.HEAD_DIM_PAIRS
    assert backend.unsupported_reason(_call(head_dim=192, head_dim_v=128)) is None
    with pytest.raises(ValueError, match="CUDA tensors"):  # on: refused only at the device check
        flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match="CUDA tensors"):
        flash_attn_varlen_func(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu)
    cute_env(DISABLE="hdim_v")
    with pytest.raises(NotImplementedError, match="head dim of v"):
        interface._check_dims(192, 128, 4, 2)
    with pytest.raises(NotImplementedError, match="head dim of v"):
        flash_attn_func(q, k, v)
    with pytest.raises(NotImplementedError, match="head dim of v"):
        flash_attn_varlen_func(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu)
    why = backend.unsupported_reason(_call(head_dim=192, head_dim_v=128))
    assert why is not None and settings.DISABLE in why and "hdim_v" in why, why
    interface._check_dims(192, 192, 4, 2)  # equal head dims are untouched
    assert backend.unsupported_reason(_call(head_dim=192, head_dim_v=192)) is None


# ----------------------------------------------------------------------------------------------------
# Plan rules


def test_pack_gqa_auto_turns_on_the_choose_rule(cute_env):
    # pack_gqa=None (FA4's "choose"): unpacked by default; with plan.pack_gqa_auto=1 packed where _pack_helps says
    # the packed tiles hold more real queries (decoding), unpacked where they do not (a long prompt)
    assert not config.plan_rules().pack_gqa_auto
    assert plan._pack_group(None, 8, 2, 1) == 1 and plan._pack_group(None, 8, 2) == 1
    cute_env(OVERRIDES="plan.pack_gqa_auto=1")
    assert config.plan_rules().pack_gqa_auto
    assert plan._pack_helps(4, 1) and not plan._pack_helps(4, 4096)
    assert plan._pack_group(None, 8, 2, 1) == 4 and plan._pack_group(None, 8, 2) == 4  # (unknown length: pack)
    assert plan._pack_group(None, 8, 2, 4096) == 1
    assert plan._pack_group(None, 6, 2, 1) == 1  # a group of 3: no packed kernel
    assert plan._pack_group(False, 8, 2, 1) == 1  # an explicit False stays unpacked
    cute_env(OVERRIDES="plan.pack_gqa_auto=0")
    assert plan._pack_group(None, 8, 2, 1) == 1


def test_bwd_host_torch_turns_the_triton_host_path_off(cute_env, monkeypatch):
    from flash_attn.cute import bwd_host

    # Triton present and able to run on this tensor (the interpreter on CPU): only the plan rule decides
    if bwd_host.triton is None:
        monkeypatch.setattr(bwd_host, "triton", object())
    monkeypatch.setattr(bwd_host, "_INTERPRET", True)
    t = torch.zeros(1)
    assert config.plan_rules().bwd_host == "triton"
    assert bwd_host.use_triton(t) is True
    cute_env(OVERRIDES="plan.bwd_host=torch")
    assert config.plan_rules().bwd_host == "torch"
    assert bwd_host.use_triton(t) is False
    cute_env(OVERRIDES="plan.bwd_host=triton")
    assert bwd_host.use_triton(t) is True


# ----------------------------------------------------------------------------------------------------
# One reader


def test_only_settings_reads_the_environment():
    """Every environment variable of flash_attn.cute is read in settings.py (the others ask settings.current)."""
    src = os.path.join(_PKG, "flash_attn", "cute")
    paths = sorted(glob.glob(os.path.join(src, "*.py")))
    assert len(paths) > 10 and os.path.join(src, "settings.py") in paths
    pattern = re.compile(r"\benviron\b|\bgetenv\b|\bputenv\b")
    readers = {os.path.basename(p) for p in paths if pattern.search(open(p).read())}
    assert readers == {"settings.py"}, readers
