"""FA4's score_mod / mask_mod / aux_tensors in flash_attn.cute (forward): the sm_90a compile of mod kernels on the
CPU (the mod visible in the PTX, ptxas without spills), the plan rule that gates the API, the in-memory key, and
GPU tests against a plain fp32 PyTorch attention with the same bias / mask (and FlexAttention where torch has it).
Mods: tests/cute/_cute_mods.py. Heavier compiles run with FLASH_ATTN_TEST_MOD_COMPILES=all."""
import glob
import math
import os
import shutil

import pytest
import torch

pytest.importorskip("cutlass")

import cutlass.cute as cute  # noqa: E402

from flash_attn.cute import interface, mods  # noqa: E402
from flash_attn.testing import assert_ptxas_clean  # noqa: E402

import _cute_mods as m  # noqa: E402

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a Hopper (sm_90) GPU")
ALL = os.environ.get("FLASH_ATTN_TEST_MOD_COMPILES") == "all"

# (name, compile_fwd_mods keywords): six kernels by default, covering d64 / d128, causal / not / window, dense /
# varlen, a score_mod, a mask_mod, both, and aux tensors (1-D fp32 and 2-D int32).
COMPILES = [
    ("rel_bias-d128", dict(dtype=torch.bfloat16, head_dim=128, causal=False, score_mod=m.rel_bias)),
    ("alibi_aux-d64-causal", dict(dtype=torch.bfloat16, head_dim=64, causal=True, score_mod=m.alibi_aux,
                                  spec=((torch.float32, 1),))),
    ("softcap+causal_mask-d64", dict(dtype=torch.bfloat16, head_dim=64, causal=False, score_mod=m.softcap,
                                     mask_mod=m.causal_mask)),
    ("document-d128-fp16", dict(dtype=torch.float16, head_dim=128, causal=False, mask_mod=m.document_mask,
                                spec=((torch.int32, 2),))),
    ("window_mask-varlen-d128", dict(dtype=torch.bfloat16, head_dim=128, causal=False, varlen=True,
                                     mask_mod=m.window_mask)),
    ("identity-d128-causal-window", dict(dtype=torch.bfloat16, head_dim=128, causal=False, local=True,
                                         score_mod=m.identity)),
]
HEAVY = [
    ("rel_bias-d64-varlen-causal", dict(dtype=torch.bfloat16, head_dim=64, causal=True, varlen=True,
                                        score_mod=m.rel_bias)),
    ("alibi_aux-d128-causal", dict(dtype=torch.float16, head_dim=128, causal=True, score_mod=m.alibi_aux,
                                   spec=((torch.float32, 1),))),
    ("window_mask-d64", dict(dtype=torch.bfloat16, head_dim=64, causal=False, mask_mod=m.window_mask)),
]


def _params():
    return [pytest.param(kw, id=name) for name, kw in COMPILES] + [
        pytest.param(kw, id=name, marks=pytest.mark.skipif(not ALL, reason="FLASH_ATTN_TEST_MOD_COMPILES=all"))
        for name, kw in HEAVY]


@pytest.fixture(scope="module", params=_params())
def mod_ptx(request, tmp_path_factory):
    dump = tmp_path_factory.mktemp("modptx")
    mods.compile_fwd_mods(arch="sm_90a", dump_dir=str(dump), **request.param)
    paths = glob.glob(os.path.join(dump, "**", "*.ptx"), recursive=True)
    assert len(paths) == 1, paths
    return request.param, paths[0]


def test_mod_kernel_compiles_for_sm90a(mod_ptx):
    kw, path = mod_ptx
    text = open(path).read()
    assert ".target sm_90a" in text
    assert "wgmma.mma_async" in text


def test_the_mod_is_in_the_ptx(mod_ptx):
    kw, path = mod_ptx
    text = open(path).read()
    if kw.get("score_mod") is m.rel_bias:
        assert "0f3C23D70A" in text  # REL_SCALE 0.01
    if kw.get("score_mod") is m.softcap:
        assert "tanh.approx.f32" in text
    if kw.get("spec"):  # aux tensors are read from global memory in the consumer loop
        assert "ld.global" in text


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
def test_mod_kernel_does_not_spill(mod_ptx):
    assert_ptxas_clean(mod_ptx[1])


# --- the in-memory key ----------------------------------------------------------------------------------------

def test_two_mods_never_share_a_kernel(monkeypatch):
    built = []
    monkeypatch.setattr(mods, "compile_fwd_mods", lambda *a, **kw: built.append(kw) or object())
    monkeypatch.setattr(mods, "_mod_kernels", {})
    from flash_attn.cute import kernels
    monkeypatch.setattr(kernels, "_ffi_function", lambda f: f)
    monkeypatch.setattr(kernels, "_tvm_ffi", lambda: True)
    args = (torch.bfloat16, 128, False, "sm_90a", False, False)
    a = mods.mod_kernel(*args, m.rel_bias, None, ())
    b = mods.mod_kernel(*args, m.softcap, None, ())
    c = mods.mod_kernel(*args, m.rel_bias, None, ())
    d = mods.mod_kernel(*args, m.rel_bias, m.causal_mask, ())
    e = mods.mod_kernel(*args, m.alibi_aux, None, ((torch.float32, 1),))
    f = mods.mod_kernel(*args, m.alibi_aux, None, ((torch.float16, 1),))
    assert a is c and len({id(x) for x in (a, b, d, e, f)}) == 5
    assert [kw["score_mod"] for kw in built] == [m.rel_bias, m.softcap, m.rel_bias, m.alibi_aux, m.alibi_aux]


def test_equal_source_other_closure_is_another_kernel(monkeypatch):
    """Two closures of one source (a bias constant each) are two kernels: the key is the function object."""
    monkeypatch.setattr(mods, "compile_fwd_mods", lambda *a, **kw: object())
    monkeypatch.setattr(mods, "_mod_kernels", {})
    from flash_attn.cute import kernels
    monkeypatch.setattr(kernels, "_ffi_function", lambda f: f)
    monkeypatch.setattr(kernels, "_tvm_ffi", lambda: True)

    def make(c):
        def mod(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            return score + c
        return mod

    args = (torch.bfloat16, 64, False, "sm_90a", False, False)
    assert mods.mod_kernel(*args, make(1.0), None, ()) is not mods.mod_kernel(*args, make(2.0), None, ())


_BIAS = 2.0
_USER_MODULE = type(os)("my_constants")  # a user's module: its attributes may change, so it is not keyed by value
_USER_MODULE.BIAS = 1.0


def make_reading_a_user_module():
    c = 0.0

    def mod(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return score + c + _USER_MODULE.BIAS
    return mod


def make_global():
    c = 1.0

    @cute.jit
    def mod(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return score + c + _BIAS
    return mod


def test_a_closure_made_per_call_with_the_same_values_reuses_its_kernel(monkeypatch):
    """A mod built anew for every call (a closure of the same def, equal cell values, cute.jit or not) compiles once;
    other values, another def, a signed zero, or a cell the key cannot describe by value (a tensor: the function
    object keys itself) give other kernels."""
    built = []
    monkeypatch.setattr(mods, "compile_fwd_mods", lambda *a, **kw: built.append(kw) or object())
    monkeypatch.setattr(mods, "_mod_kernels", {})
    from flash_attn.cute import kernels
    monkeypatch.setattr(kernels, "_ffi_function", lambda f: f)
    monkeypatch.setattr(kernels, "_tvm_ffi", lambda: True)

    def make(c, jit=True):
        def mod(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            return score + c
        return cute.jit(mod) if jit else mod

    def make_other(c):
        @cute.jit
        def mod(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            return score - c
        return mod

    args = (torch.bfloat16, 64, False, "sm_90a", False, False)
    k = lambda f: mods.mod_kernel(*args, f, None, ())  # noqa: E731
    assert k(make(1.0)) is k(make(1.0)) and len(built) == 1
    assert k(make(1.0, jit=False)) is k(make(1.0, jit=False)) and len(built) == 2
    assert len({id(k(make(2.0))), id(k(make(1.0))), id(k(make_other(1.0))), id(k(make(-0.0))), id(k(make(0.0))),
                id(k(make(1)))}) == 6
    t = torch.ones(1)
    assert k(make(t)) is not k(make(t))  # (a tensor in a cell: by identity, a kernel per function object)
    first = k(make_global())
    assert k(make_global()) is first
    monkeypatch.setattr(__import__(__name__), "_BIAS", 3.0)
    assert k(make_global()) is not first  # a global the code names is part of the key
    g = make_reading_a_user_module()
    assert mods.fn_key(g) is g  # (nothing to key a user's module by: the function object keys itself)
    f = make(t)
    assert mods.fn_key(f) is f and mods.fn_key(m.rel_bias) == mods.fn_key(m.rel_bias)


def test_aux_spec_checks_the_tensors():
    assert mods.aux_spec(None, torch.device("cpu")) == ()
    assert mods.aux_spec([torch.zeros(3), torch.zeros(2, 4, dtype=torch.int32)], torch.device("cpu")) == (
        (torch.float32, 1), (torch.int32, 2))
    with pytest.raises(ValueError, match="aux_tensors\\[0\\] must be a tensor"):
        mods.aux_spec([1.0], torch.device("cpu"))
    with pytest.raises(ValueError, match="must be on"):
        mods.aux_spec([torch.zeros(3)], torch.device("meta"))
    with pytest.raises(ValueError, match="dtype"):
        mods.aux_spec([torch.zeros(3, dtype=torch.complex64)], torch.device("cpu"))


def test_mod_config_is_the_one_tile_kernel():
    for d, causal, local in ((64, False, False), (64, True, False), (128, False, True), (256, True, False)):
        cfg = mods.mod_config(torch.bfloat16, d, causal, "sm_90a", local, False, "tvm-ffi-env-stream")
        assert not cfg.persistent and cfg.warpgroups == 2 and cfg.tma_o and not cfg.tiles_desc
    # O through shared memory and TMA on dense calls; varlen's rows stop at each sequence's end: the direct store
    assert not mods.mod_config(torch.bfloat16, 128, False, "sm_90a", False, True, "tvm-ffi-env-stream").tma_o


def test_block_sparse_mod_kernels_run_the_last_query_tiles_first(cute_env, monkeypatch):
    """Block-sparse lists mostly grow with the query block (causal, prefix-LM, ALiBi + causal): the kernel's grid
    runs each head's query tiles from the last down, as a causal kernel's, unless an override says otherwise."""
    from flash_attn.cute import mod_library

    built = []
    monkeypatch.setattr(cute, "compile", lambda entry, *a, **k: built.append(entry.__self__))
    for overrides, desc in (("", True), ("fwd.tiles_desc=0", False)):
        cute_env(OVERRIDES=overrides)
        cfg = mods.mod_config(torch.bfloat16, 128, False, "sm_90a", False, False, "tvm-ffi-env-stream", sparse=True)
        assert cfg.tiles_desc == desc and not cfg.causal
        mods.compile_fwd_mods(torch.bfloat16, 128, False, mask_mod=mod_library.causal().mask_mod, sparse=(True, 1, 1))
        assert built[-1].scheduler.causal == desc and not built[-1].causal  # tile_scheduler.OneTileScheduler's order
    mods.compile_fwd_mods(torch.bfloat16, 128, False, mask_mod=mod_library.causal().mask_mod)  # no lists
    assert not built[-1].scheduler.causal
    # the knobs: lpt's sectioned order over the descending tiles (an experiment), the TMA O store (on by default)
    cute_env(OVERRIDES="fwd.lpt=1,fwd.tma_o=0")
    mods.compile_fwd_mods(torch.bfloat16, 128, False, mask_mod=mod_library.causal().mask_mod, sparse=(True, 1, 1))
    assert built[-1].lpt and not built[-1].tma_o
    cute_env(OVERRIDES="")
    mods.compile_fwd_mods(torch.bfloat16, 128, True, score_mod=mod_library.softcap(30.0).score_mod)
    assert built[-1].lpt and built[-1].tma_o  # a causal call keeps the native causal kernel's lpt order


# --- the plan rule and the API ----------------------------------------------------------------------------------

def _qkv(varlen=False, d=64):
    lead = (14,) if varlen else (2, 7)
    q = torch.randn(*lead, 4, d, dtype=torch.bfloat16)
    k = torch.randn(*lead, 2, d, dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


class _ModLaunch:
    """Stands in for mods.forward / forward_varlen (CPU tensors): records what reaches them."""

    def __init__(self, monkeypatch):
        self.calls = []
        monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
        monkeypatch.setattr(mods, "forward", self.dense)
        monkeypatch.setattr(mods, "forward_varlen", self.varlen)

    def dense(self, q, k, v, scale, causal, arch, wl, wr, score_mod, mask_mod, aux, block_sparse=None,
              aux_scalars=None, sink=None):
        self.calls.append(dict(kind="dense", scale=scale, causal=causal, window=(wl, wr), score_mod=score_mod,
                               mask_mod=mask_mod, aux=aux, scalars=aux_scalars, sink=sink))
        B, Sq, H, _ = q.shape
        g = torch.Generator().manual_seed(1)
        return torch.randn(q.shape, generator=g).to(q.dtype), torch.randn(B, H, Sq, generator=g)

    def varlen(self, q, k, v, cu_q, cu_k, used_k, max_q, scale, causal, arch, wl, wr, score_mod, mask_mod, aux,
               aux_scalars=None, block_sparse=None, max_seqlen_k=None, sink=None):
        self.calls.append(dict(kind="varlen", scale=scale, causal=causal, max_q=max_q, score_mod=score_mod,
                               mask_mod=mask_mod, aux=aux, scalars=aux_scalars, block_sparse=block_sparse,
                               max_k=max_seqlen_k, sink=sink))
        g = torch.Generator().manual_seed(1)
        return torch.randn(q.shape, generator=g).to(q.dtype), torch.randn(q.shape[1], q.shape[0], generator=g)


@pytest.fixture
def defaults(cute_env):
    """The default settings (nothing overridden or switched off)."""
    cute_env()


def test_passes_the_mods_to_the_launch(defaults, monkeypatch):
    rec = _ModLaunch(monkeypatch)
    q, k, v = _qkv()
    aux = [torch.ones(4)]
    out, lse = interface.flash_attn_func(q, k, v, score_mod=m.alibi_aux, aux_tensors=aux, causal=True,
                                         return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 7)
    call, = rec.calls
    assert call["score_mod"] is m.alibi_aux and call["mask_mod"] is None and call["aux"] is aux
    assert call["causal"] and math.isclose(call["scale"], 64 ** -0.5)
    interface.flash_attn_func(q, k, v, mask_mod=m.window_mask, softmax_scale=0.5)
    assert rec.calls[-1]["mask_mod"] is m.window_mask and rec.calls[-1]["scale"] == 0.5


def test_learnable_sink_reaches_the_mod_launch_and_gets_its_gradient(defaults, monkeypatch):
    """A learnable sink with mods (FA4 allows it): the mod kernels get it as fp32 (H,), dense and varlen, and its
    gradient is autograd.sink_grad's of the forward's out and lse (the backward kernels need no sink: the lse holds
    it); _flash_attn_bwd with mods appends it too."""
    from flash_attn.cute import autograd, launch, lowlevel

    rec = _ModLaunch(monkeypatch)
    monkeypatch.setattr(mods, "backward", lambda dout, q, k, v, *a: (torch.zeros_like(q), torch.zeros_like(k),
                                                                     torch.zeros_like(v)))
    monkeypatch.setattr(mods, "backward_varlen", lambda dout, q, k, v, *a: (torch.zeros_like(q), torch.zeros_like(k),
                                                                            torch.zeros_like(v)))
    q, k, v = _qkv()
    sink = torch.randn(4, dtype=torch.bfloat16)
    interface.flash_attn_func(q, k, v, mask_mod=m.causal_mask, learnable_sink=sink)
    got = rec.calls[-1]["sink"]
    assert got.dtype == torch.float32 and got.is_contiguous() and torch.equal(got, sink.float())
    sink.requires_grad_(True)
    dout = torch.randn_like(q)
    out, lse = interface.flash_attn_func(q, k, v, score_mod=m.identity, score_mod_bwd=m.additive_bwd,
                                         learnable_sink=sink, return_lse=True)
    out.backward(dout)
    want = autograd.sink_grad(dout, out.detach(), lse.detach(), sink.detach())
    assert sink.grad.dtype == sink.dtype and torch.allclose(sink.grad.float(), want.to(sink.dtype).float())
    assert torch.equal(rec.calls[-1]["sink"], sink.detach().float())
    sink.grad = None
    qv, kv, vv = _qkv(varlen=True)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    out, lse = interface.flash_attn_varlen_func(qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, mask_mod=m.causal_mask,
                                                learnable_sink=sink, return_lse=True)
    assert rec.calls[-1]["kind"] == "varlen" and torch.equal(rec.calls[-1]["sink"], sink.detach().float())
    douv = torch.randn_like(qv)
    out.backward(douv)
    want = autograd.sink_grad(douv, out.detach(), lse.detach(), sink.detach())
    assert torch.allclose(sink.grad.float(), want.to(sink.dtype).float())
    monkeypatch.setattr(launch, "_device_arch", lambda q, k, v: "sm_90a")
    grads = lowlevel._flash_attn_bwd(q, k, v, out=torch.randn_like(q), dout=dout, lse=torch.randn(2, 4, 7),
                                     mask_mod=m.causal_mask, learnable_sink=sink.detach())
    assert len(grads) == 4 and grads[3].shape == (4,) and grads[3].dtype == sink.dtype


def test_varlen_passes_the_mods(defaults, monkeypatch):
    rec = _ModLaunch(monkeypatch)
    q, k, v = _qkv(varlen=True)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    out, lse = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                score_mod=m.rel_bias, mask_mod=m.causal_mask, return_lse=True)
    call, = rec.calls
    assert call["kind"] == "varlen" and call["max_q"] == 9
    assert call["score_mod"] is m.rel_bias and call["mask_mod"] is m.causal_mask
    # batch-shaped inputs: the sequences are the batch entries
    qb, kb, vb = _qkv()
    interface.flash_attn_varlen_func(qb, kb, vb, score_mod=m.identity)
    assert rec.calls[-1]["kind"] == "varlen" and rec.calls[-1]["max_q"] == 7
    # block sparsity (FA4's varlen lists) reaches the launch with the longest key count
    lists = object()
    interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, mask_mod=m.causal_mask,
                                     block_sparse_tensors=lists)
    assert rec.calls[-1]["block_sparse"] is lists and rec.calls[-1]["max_k"] == 9


@cute.jit
def _score_mod_flex_style(score, b, h, q_idx, kv_idx):  # FlexAttention's convention, not FA4's
    return score


@cute.jit
def _mask_mod_too_few(b_idx, h_idx, q_idx, kv_idx):
    return kv_idx[0] <= q_idx[0]


@cute.jit
def _score_mod_bwd_too_few(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info):
    return grad


@pytest.mark.parametrize("kw, err, match", [
    (dict(score_mod=_score_mod_flex_style), ValueError, r"score_mod must take \(score, b_idx, h_idx, q_idx"),
    (dict(mask_mod=_mask_mod_too_few), ValueError, r"mask_mod must take \(b_idx, h_idx, q_idx, kv_idx, seqlen_info"),
    (dict(score_mod=m.rel_bias, score_mod_bwd=_score_mod_bwd_too_few), ValueError, "score_mod_bwd must take"),
    (dict(score_mod=m.softcap, softcap=5.0), ValueError, "softcap and score_mod"),
    (dict(mask_mod=m.causal_mask, causal=True), ValueError, "causal"),
    (dict(mask_mod=m.window_mask, window_size=(8, 8)), ValueError, "window_size"),
    (dict(aux_tensors=[torch.zeros(1)]), ValueError, "nothing reads them"),
    (dict(score_mod=m.identity, learnable_sink=torch.zeros(5)), ValueError, "learnable_sink must have shape"),
    (dict(score_mod_bwd=m.additive_bwd), ValueError, "without a score_mod"),
    (dict(score_mod=m.identity, block_sparse_tensors_bwd=object()), ValueError, "without block_sparse_tensors"),
    (dict(score_mod=m.identity, aux_scalars=(1.0,)), ValueError, "aux_scalars without"),
    (dict(score_mod=m.scaled, aux_scalars=("x",)), ValueError, r"aux_scalars\[0\]"),
    (dict(score_mod=3), ValueError, "CuTeDSL function"),
])
def test_refuses_what_is_not_served(defaults, monkeypatch, kw, err, match):
    _ModLaunch(monkeypatch)
    q, k, v = _qkv()
    with pytest.raises(err, match=match):
        interface.flash_attn_func(q, k, v, **kw)


def test_compute_block_sparsity_checks_the_mask_mods_signature():
    from flash_attn.cute.compute_block_sparsity import compute_block_sparsity

    with pytest.raises(ValueError, match="mask_mod must take"):
        compute_block_sparsity(128, 128, 1, 1, 256, 256, _mask_mod_too_few, None, "cpu")


def test_backward_with_mods_is_refused_naming_score_mod(defaults, monkeypatch):
    _ModLaunch(monkeypatch)
    q, k, v = _qkv()
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="needs score_mod_bwd"):
        interface.flash_attn_func(q, k, v, score_mod=m.rel_bias)
    with torch.no_grad():
        interface.flash_attn_func(q, k, v, score_mod=m.rel_bias)


def test_other_head_dims_are_refused_not_padded(defaults, monkeypatch):
    _ModLaunch(monkeypatch)
    q, k, v = _qkv(d=40)
    with pytest.raises(NotImplementedError, match="head dims 40"):
        interface.flash_attn_func(q, k, v, score_mod=m.rel_bias)
    qv, kv, vv = _qkv(varlen=True, d=40)
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="head dims 40"):
        interface.flash_attn_varlen_func(qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, score_mod=m.rel_bias)


def test_wide_head_dims_backward_is_served(cute_env, monkeypatch):
    """The mods backward at d192 / d256 (the split-D kernel; GPU-tested): served, a mask_mod's own lists built per 64
    keys (the split-D kernel's key block), block_sparse_tensors_bwd refused there, the 192 / 128 pair refused."""
    from flash_attn.cute import launch

    U = mods._UNBOUNDED
    cute_env()
    for d in (192, 256):
        mods.check_call(m.rel_bias, None, None, False, U, U, 0.0, True, d, d, score_mod_bwd=m.additive_bwd)
        with pytest.raises(NotImplementedError, match="block_sparse_tensors_bwd"):
            mods.check_call(None, m.causal_mask, None, False, U, U, 0.0, True, d, d,
                            block_sparse=object(), block_sparse_bwd=object())
    with pytest.raises(NotImplementedError, match="head dims"):  # (the pair stays refused)
        mods.check_call(m.rel_bias, None, None, False, U, U, 0.0, True, 192, 128, score_mod_bwd=m.additive_bwd)
    assert mods.bwd_block_n(256) == mods.bwd_block_n(192) == 64 and mods.bwd_block_n(128) == 128

    seen = {}
    monkeypatch.setattr(mods, "mask_lists_bwd", lambda *a, **kw: seen.setdefault("lists", a) and ("lists",))
    monkeypatch.setattr(mods, "mod_bwd_kernel", lambda *a, **kw: seen.setdefault("kernel", (a, kw)) and "fn")
    monkeypatch.setattr(launch, "backward", lambda *a, **kw: seen.setdefault("launch", kw) and "grads")
    q, k, v = (torch.randn(1, 130, 2, 256, dtype=torch.bfloat16) for _ in range(3))
    lse = torch.zeros(1, 2, 130)
    assert mods.backward(q, q, k, v, q, lse, None, 0.1, "sm_90a", None, None, m.causal_mask, None, None, None,
                         False) == "grads"
    assert seen["lists"][5:7] == (64, 64)  # block_m, block_n: the split-D kernel's tiles
    assert seen["kernel"][0][5] == (True, 1, 1) and seen["launch"]["mod"][2] == ("lists",)


def test_wide_head_dim_mod_backward_kernels_compile_spill_free(tmp_path):
    """The split-D backward kernel with a mask_mod walking its per-64-key lists (d256) and with a score_mod and a
    window (d192): sm_90a, ptxas without spills or serialised WGMMAs."""
    import glob as _glob

    from flash_attn.cute import kernels

    for name, d, kw in (("mask", 256, dict(mask_mod=m.causal_mask, sparse=(True, 1, 1))),
                        ("score", 192, dict(score_mod=m.rel_bias, score_mod_bwd=m.additive_bwd, local=True))):
        dump = tmp_path / name
        dump.mkdir()
        kernels.compile_bwd(torch.bfloat16, d, False, "sm_90a", dump_dir=str(dump), **kw)
        (ptx,) = _glob.glob(str(dump / "*.ptx"))
        if shutil.which("ptxas"):
            assert_ptxas_clean(ptx)


# --- GPU: against a plain fp32 attention with the same bias / mask ------------------------------------------------

def _reference(q, k, v, scale, score_fn=None, mask=None, causal=False, aux=None, dtype=torch.float32):
    """Attention in ``dtype`` (fp32: the oracle; the input dtype: PyTorch's own low-precision error) of (B, S, H, D)
    q and (B, S, Hk, D) k / v (GQA by repeat): scores * scale, then score_fn, then the boolean mask (B or 1, 1, Sq,
    Sk) and causal (bottom-right), softmax; fully masked rows give 0. Returns fp32."""
    g = q.shape[2] // k.shape[2]
    qf = q.to(dtype).transpose(1, 2)
    kf = k.to(dtype).repeat_interleave(g, dim=2).transpose(1, 2)
    vf = v.to(dtype).repeat_interleave(g, dim=2).transpose(1, 2)
    s = qf @ kf.transpose(-1, -2) * scale
    if score_fn is not None:
        s = score_fn(s, aux).to(dtype)  # (an fp32 aux tensor promotes the scores)
    Sq, Sk = s.shape[-2:]
    keep = torch.ones(Sq, Sk, dtype=torch.bool, device=s.device)
    if causal:
        keep = m.causal_mask_torch(Sq, Sk, s.device)
    if mask is not None:
        keep = keep & mask
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2).float()


def _check(out, q, k, v, scale, **kw):
    """Error against the fp32 oracle at most 2x PyTorch's own in q's dtype, plus the dtype's rounding of out."""
    ref = _reference(q, k, v, scale, **kw)
    ref_lp = _reference(q, k, v, scale, dtype=q.dtype, **kw)
    err = (out.float() - ref).abs().max().item()
    bound = 2 * (ref_lp - ref).abs().max().item() + (ref.abs().max().item() * 2 ** -8)
    assert err <= bound, (err, bound)


CASES = [("identity", None), ("rel_bias", None), ("softcap", None), ("alibi_aux", None), (None, "causal"),
         (None, "window"), (None, "document"), ("rel_bias", "causal")]


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("score, mask", CASES)
@pytest.mark.parametrize("Sq, Sk", [(128, 128), (113, 203), (256, 97)])
def test_dense_matches_the_reference(defaults, d, causal, score, mask, Sq, Sk):
    if mask is not None and causal:
        pytest.skip("mask_mod with causal=True is refused (put the condition in the mask_mod)")
    if mask == "document" and Sq != Sk:
        pytest.skip("the document ids cover one length")
    torch.manual_seed(0)
    B, H, Hk = 2, 4, 2
    q = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Sk, Hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    aux = None
    if score == "alibi_aux":
        aux = [torch.rand(H, device="cuda") * 0.1]
    if mask == "document":
        aux = [torch.sort(torch.randint(0, 4, (B, Sq), device="cuda"), dim=1).values.to(torch.int32)]
    score_mod, score_fn = m.SCORE_MODS[score] if score else (None, None)
    mask_mod, mask_fn = m.MASK_MODS[mask] if mask else (None, None)
    out = interface.flash_attn_func(q, k, v, causal=causal, score_mod=score_mod, mask_mod=mask_mod,
                                    aux_tensors=aux)[0]
    keep = mask_fn(Sq, Sk, q.device, aux) if mask_fn else None
    _check(out, q, k, v, d ** -0.5, score_fn=score_fn, mask=keep, causal=causal, aux=aux)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("score, mask", [("rel_bias", None), (None, "causal"), ("alibi_aux", None)])
def test_varlen_indices_are_per_sequence(defaults, score, mask):
    """q_idx / kv_idx count from each sequence's first row; the batch index is the sequence's."""
    torch.manual_seed(0)
    lens = [37, 128, 5, 200]
    H, Hk, d = 4, 4, 128
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
    T = int(cu[-1])
    q = torch.randn(T, H, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    aux = [torch.rand(H, device="cuda") * 0.1] if score == "alibi_aux" else None
    score_mod, score_fn = m.SCORE_MODS[score] if score else (None, None)
    mask_mod, mask_fn = m.MASK_MODS[mask] if mask else (None, None)
    out = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                                           max_seqlen_k=max(lens), score_mod=score_mod, mask_mod=mask_mod,
                                           aux_tensors=aux)[0]
    for b, n in enumerate(lens):
        s, e = int(cu[b]), int(cu[b + 1])
        keep = mask_fn(n, n, q.device) if mask_fn else None
        _check(out[s:e][None], q[s:e][None], k[s:e][None], v[s:e][None], d ** -0.5, score_fn=score_fn, mask=keep,
               aux=aux)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("score", ["rel_bias", "softcap", "alibi_aux"])
def test_against_flex_attention(defaults, score):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(0)
    B, S, H, d = 2, 256, 4, 128
    q = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    aux = [torch.rand(H, device="cuda") * 0.1] if score == "alibi_aux" else None
    score_mod, _ = m.SCORE_MODS[score]

    def flex_mod(s, b, h, qi, ki):  # FlexAttention's score is already scaled, as FA4's
        if score == "rel_bias":
            return s + (ki - qi).float() * m.REL_SCALE
        if score == "softcap":
            return m.SOFTCAP * torch.tanh(s / m.SOFTCAP)
        return s - aux[0][h] * (qi - ki).abs().float()

    ref = flex.flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), score_mod=flex_mod).transpose(1, 2)
    out = interface.flash_attn_func(q, k, v, score_mod=score_mod, aux_tensors=aux)[0]
    exact = _reference(q, k, v, d ** -0.5, score_fn=m.SCORE_MODS[score][1], aux=aux)
    assert (out.float() - exact).abs().max() <= 2 * (ref.float() - exact).abs().max() + 2e-3


def gpu_kernel_requests():
    """The mod kernels are never on disk (mods.py): nothing to precompile."""
    return []


# --- the backward (score_mod through FA4's score_mod_bwd, with or without a mask_mod) ------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [[(128, 128), (128, 128)], [(1, 4096), (1, 4096), (1, 4096)],
                                  [(64, 128), (56, 200), (128, 64)]])
def test_varlen_score_mod_reading_aux_at_global_keys(defaults, dtype, lens):
    """A score_mod (and its gradient) reading an aux tensor at the key's packed row (kv_idx + offset_k), the mod of
    FA4's test_varlen_score_mod_backward_with_global: forward and gradients of every sequence against PyTorch autograd
    on the sequence alone. (That FA4 test's own reference, eager flex_attention per sequence, disagrees in dQ with the
    released FA4 and with this package alike, by the same amounts, on Hopper: this test is the check of the gradient.)"""
    torch.manual_seed(12)
    H, d = 4, 128
    cu_q = torch.tensor([0] + list(torch.tensor([a for a, _ in lens]).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor([b for _, b in lens]).cumsum(0)), dtype=torch.int32, device="cuda")
    Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(Tq, H, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(Tk, H, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(Tk, H, d, device="cuda", dtype=dtype, requires_grad=True)
    dout = torch.randn(Tq, H, d, device="cuda", dtype=dtype)
    scale = torch.randn(Tk, device="cuda", dtype=dtype) * 0.1 + 1.0
    out = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                           score_mod=m.global_scaled_squared,
                                           score_mod_bwd=m.global_scaled_squared_bwd, aux_tensors=[scale])[0]
    out.backward(dout)
    for b, (sq, sk) in enumerate(lens):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        fn = lambda s, aux, rk=rk: aux[0][rk].float() * s * s  # noqa: E731
        args = (q[rq][None], k[rk][None], v[rk][None], dout[rq][None], d ** -0.5, fn, None, [scale])
        ref, ref_grads = _grads_reference(*args, torch.float32)
        ref_lp, lp_grads = _grads_reference(*args, dtype)
        got = (out[rq][None], q.grad[rq][None], k.grad[rk][None], v.grad[rk][None])
        m.assert_close_to_oracle(got, (ref, *ref_grads), (ref_lp, *lp_grads), where=(b, str(dtype)))


def _grads_reference(q, k, v, dout, scale, score_fn, keep, aux, dtype):
    qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    g = qr.shape[2] // kr.shape[2]
    s = qr.transpose(1, 2) @ kr.repeat_interleave(g, 2).transpose(1, 2).transpose(-1, -2) * scale
    if score_fn is not None:
        s = score_fn(s, aux).to(dtype)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    o = (p @ vr.repeat_interleave(g, 2).transpose(1, 2)).transpose(1, 2)
    o.backward(dout.to(dtype))
    return o.float(), [t.grad.float() for t in (qr, kr, vr)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("score", ["identity", "rel_bias", "softcap", "alibi_aux"])
@pytest.mark.parametrize("mask", [None, "causal", "native causal"])
def test_score_mod_gradients_match_the_reference(defaults, d, score, mask):
    _check_score_mod_gradients(d, score, mask)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("score", ["identity", "rel_bias", "softcap", "alibi_aux"])
@pytest.mark.parametrize("mask", [None, "causal", "native causal"])
def test_score_mod_gradients_at_wide_head_dims(cute_env, d, score, mask):
    # the split-D kernel (its mask_mod lists per 64 keys)
    _check_score_mod_gradients(d, score, mask)


def _check_score_mod_gradients(d, score, mask):
    torch.manual_seed(9)
    B, H, Hk, Sq, Sk = 2, 4, 2, 300, 517
    q = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Sk, Hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Sk, Hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.bfloat16)
    fn, fn_torch = m.SCORE_MODS[score]
    aux = [torch.rand(H, device="cuda") * 0.1] if score == "alibi_aux" else None
    mask_fn, keep = None, None
    if mask:
        mask_fn, mask_torch = m.MASK_MODS["causal"]
        keep = mask_torch(Sq, Sk, "cuda")
    native = mask == "native causal"  # causal=True instead of the mask_mod
    scale = d ** -0.5
    out = interface.flash_attn_func(q, k, v, score_mod=fn, score_mod_bwd=m.SCORE_MOD_BWDS[score],
                                    mask_mod=None if native else mask_fn, causal=native, aux_tensors=aux,
                                    softmax_scale=scale)[0]
    out.backward(dout)
    ref, ref_grads = _grads_reference(q, k, v, dout, scale, fn_torch, keep, aux, torch.float32)
    ref_lp, lp_grads = _grads_reference(q, k, v, dout, scale, fn_torch, keep, aux, torch.bfloat16)
    m.assert_close_to_oracle((out, q.grad, k.grad, v.grad), (ref, *ref_grads), (ref_lp, *lp_grads))


@pytest.mark.gpu
@needs_gpu
def test_score_mod_bwd_reads_aux_scalars(defaults):
    torch.manual_seed(10)
    B, H, S, d = 1, 2, 256, 64
    q, k, v = (torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    out = interface.flash_attn_func(q, k, v, score_mod=m.scaled, score_mod_bwd=m.scaled_bwd, aux_scalars=[0.25])[0]
    out.backward(dout)
    ref, ref_grads = _grads_reference(q, k, v, dout, d ** -0.5, lambda s, a: s * 0.25, None, None, torch.float32)
    ref_lp, lp_grads = _grads_reference(q, k, v, dout, d ** -0.5, lambda s, a: s * 0.25, None, None, torch.bfloat16)
    m.assert_close_to_oracle((out, q.grad, k.grad, v.grad), (ref, *ref_grads), (ref_lp, *lp_grads))


def test_score_mod_backward_kernel_compiles_without_spills(tmp_path):
    from flash_attn.cute import kernels

    kernels.compile_bwd(torch.bfloat16, 64, False, "sm_90a", dump_dir=str(tmp_path), score_mod=m.softcap,
                        score_mod_bwd=m.softcap_bwd, mask_mod=m.causal_mask)
    ptx, = glob.glob(os.path.join(tmp_path, "**", "*.ptx"), recursive=True)
    text = open(ptx).read()
    assert "wgmma.mma_async" in text and text.count("tanh.approx.f32") >= 2  # the mod and its gradient
    if shutil.which("ptxas"):
        assert_ptxas_clean(ptx)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
def test_score_mod_backward_at_d128_keeps_p_in_16_bits(tmp_path):
    """The d128 score_mod kernel keeps P^T in 16 bits only (the fp32 scores score_mod_bwd reads hold 32 registers):
    dS^T from the unpacked 16-bit P^T (shifts and masks, bf16), ptxas keeps the WGMMAs pipelined and spills at most 24
    bytes (160 with the fp32 P^T kept and the swizzled dQ tile)."""
    import re
    import subprocess

    from flash_attn.cute import kernels

    kernels.compile_bwd(torch.bfloat16, 128, False, "sm_90a", dump_dir=str(tmp_path), score_mod=m.softcap,
                        score_mod_bwd=m.softcap_bwd)
    ptx, = glob.glob(os.path.join(tmp_path, "**", "*.ptx"), recursive=True)
    text = open(ptx).read()
    assert re.search(r"shl\.b32\s+%r\d+, %r\d+, 16;", text) and re.search(r"and\.b32\s+%r\d+, %r\d+, -65536;", text)
    log = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx, "-o", os.devnull], capture_output=True, text=True,
                         check=True).stderr
    assert not re.findall(r"\((C75\d\d)\)", log), log
    assert max(int(x) for x in re.findall(r"(\d+) bytes spill stores", log)) <= 24, log


@pytest.mark.gpu
@needs_gpu
def test_score_mod_gradients_at_d128(defaults):
    # the d128 score_mod backward: dS^T from the 16-bit P^T
    torch.manual_seed(12)
    B, H, S, d = 2, 4, 777, 128
    q, k, v = (torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    out = interface.flash_attn_func(q, k, v, score_mod=m.softcap, score_mod_bwd=m.softcap_bwd,
                                    mask_mod=m.causal_mask)[0]
    out.backward(dout)
    keep = m.causal_mask_torch(S, S, "cuda")
    ref, ref_grads = _grads_reference(q, k, v, dout, d ** -0.5, m.softcap_torch, keep, None, torch.float32)
    ref_lp, lp_grads = _grads_reference(q, k, v, dout, d ** -0.5, m.softcap_torch, keep, None, torch.bfloat16)
    m.assert_close_to_oracle((out, q.grad, k.grad, v.grad), (ref, *ref_grads), (ref_lp, *lp_grads))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("score, mask, causal", [("rel_bias", None, False), ("softcap", None, True),
                                                 (None, "window", False), ("alibi_aux", "causal", False)])
def test_varlen_mods_gradients_match_per_sequence(defaults, score, mask, causal):
    _check_varlen_mods_gradients(score, mask, causal, 64)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("score, mask, causal", [("rel_bias", None, False), ("softcap", None, True),
                                                 (None, "window", False), ("alibi_aux", "causal", False)])
@pytest.mark.parametrize("d", [192, 256])
def test_varlen_mods_gradients_at_wide_head_dims(cute_env, score, mask, causal, d):
    # the split-D kernel's varlen entry
    _check_varlen_mods_gradients(score, mask, causal, d)


def _check_varlen_mods_gradients(score, mask, causal, d):
    torch.manual_seed(11)
    H, Hk = 4, 2
    lens = [(130, 200), (64, 64), (257, 300)]
    cu_q = torch.tensor([0] + list(torch.tensor([a for a, _ in lens]).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor([b for _, b in lens]).cumsum(0)), dtype=torch.int32, device="cuda")
    Tq, Tk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(Tq, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(Tk, Hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(Tk, Hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(Tq, H, d, device="cuda", dtype=torch.bfloat16)
    fn, fn_torch = m.SCORE_MODS[score] if score else (None, None)
    mfn, mtorch = m.MASK_MODS[mask] if mask else (None, None)
    aux = [torch.rand(H, device="cuda") * 0.1] if score == "alibi_aux" else None
    out = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, score_mod=fn,
                                           score_mod_bwd=m.SCORE_MOD_BWDS[score] if score else None, mask_mod=mfn,
                                           aux_tensors=aux, causal=causal)[0]
    out.backward(dout)
    for b, (sq, sk) in enumerate(lens):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        keep = None
        if mask:
            keep = mtorch(sq, sk, "cuda")
        if causal:
            c = m.causal_mask_torch(sq, sk, "cuda")
            keep = c if keep is None else keep & c
        args = (q[rq][None], k[rk][None], v[rk][None], dout[rq][None], d ** -0.5, fn_torch, keep, aux)
        ref, ref_grads = _grads_reference(*args, torch.float32)
        ref_lp, lp_grads = _grads_reference(*args, torch.bfloat16)
        got = (out[rq][None], q.grad[rq][None], k.grad[rk][None], v.grad[rk][None])
        m.assert_close_to_oracle(got, (ref, *ref_grads), (ref_lp, *lp_grads), where=(b,))
