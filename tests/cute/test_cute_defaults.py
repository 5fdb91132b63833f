"""flash_attn.cute as users run it: no FLASH_ATTN_* setting, every kernel path (head dims 64 / 96 / 128 / 192 / 256 and
the (192, 128) pair; full, causal, sliding window, softcap, GQA, varlen, learnable sink; the gradients) in bf16 and
fp16, on shapes where an off-by-one in any mask or tile bound shows: lengths of 1, one short of and one past a
128 tile, Sq != Sk both ways, windows whose edge falls inside a tile.

On the CPU: the shape set and the accuracy criterion catch the mutations a kernel can hide behind bf16 rounding
(a softmax scale off by 1%, a causal diagonal or a window edge shifted by one key), computed with the fp32
reference standing in for a kernel that has them. On a Hopper GPU (marked gpu): the kernels against the reference
on that shape set."""
import math
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.testing import assert_close_to_ref, attention_ref  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]
# (Sq, Sk): a single token; one short of, at and one past a 128 tile; Sq > Sk (causal rows that see no key) and
# Sq < Sk (the bottom-right diagonal inside a tile)
SHAPES = [(1, 1), (127, 129), (129, 128), (128, 257), (255, 113), (77, 300)]
WINDOW = (37, 5)


def _mutant_rejected(dtype, d, mutate, shapes=SHAPES, heads=2, seed=0):
    """Whether the criterion fails on at least one shape for a kernel whose output is the fp32 reference with
    ``mutate(kwargs) -> kwargs`` applied, rounded to dtype."""
    for sq, sk in shapes:
        g = torch.Generator().manual_seed(seed + sq * 1000 + sk)
        q, k, v = (torch.randn(1, s, heads, d, generator=g).to(dtype) for s in (sq, sk, sk))
        for base in ({"causal": True}, {"window_size": WINDOW}):
            out_ref, _ = attention_ref(q, k, v, **base)
            out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **base)
            mutant, _ = attention_ref(q, k, v, **mutate(dict(base)))
            try:
                assert_close_to_ref(mutant.to(dtype), out_ref, out_pt)
            except AssertionError:
                return True
    return False


def _scaled(kw, d=64):
    kw["softmax_scale"] = 1.01 / math.sqrt(d)
    return kw


def _diagonal_shifted(kw):
    # one more key visible on the right edge: causal becomes window (-1, 1), a window's right size grows by one
    if kw.pop("causal", False):
        kw["window_size"] = (-1, 1)
    else:
        kw["window_size"] = (kw["window_size"][0], kw["window_size"][1] + 1)
    return kw


def _left_edge_shifted(kw):
    # one key fewer on the left edge; a causal mask has no left edge, so only the window case changes
    if "window_size" in kw:
        kw["window_size"] = (kw["window_size"][0] - 1, kw["window_size"][1])
    return kw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mutate", [_scaled, _diagonal_shifted, _left_edge_shifted],
                         ids=["scale+1%", "right-edge+1", "left-edge-1"])
def test_the_shape_set_rejects_kernels_off_by_a_little(dtype, mutate):
    assert _mutant_rejected(dtype, 64, mutate)


def test_the_unmutated_reference_passes_the_criterion():
    # the counterpart of the test above: the shape set does not reject an exact computation rounded to bf16
    assert not _mutant_rejected(torch.bfloat16, 64, lambda kw: kw)


# ----------------------------------------------------------------------------------------------------
# On a Hopper GPU, default settings


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture
def defaults():
    """The settings users run: no FLASH_ATTN_* variable (the suite's other files set them per test)."""
    set_here = sorted(k for k in os.environ if k.startswith("FLASH_ATTN_"))
    if set_here:
        pytest.fail(f"these GPU tests check the default configuration; unset {set_here}")


def _qkv(b, sq, sk, h, hk, d, dv, dtype, grad=False, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hk, dv, device="cuda", dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 192), (192, 128), (256, 256)]
MASKS = {"full": {}, "causal": {"causal": True}, "window": {"window_size": WINDOW},
         "causal-softcap": {"causal": True, "softcap": 15.0}}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,dv", HEAD_DIMS, ids=lambda x: str(x))
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_forward_default_matches_reference(defaults, dtype, d, dv, mask, sq, sk):
    from flash_attn.cute import flash_attn_func

    q, k, v = _qkv(2, sq, sk, 6, 2, d, dv, dtype)
    out, lse = flash_attn_func(q, k, v, return_lse=True, **MASKS[mask])
    out_ref, _ = attention_ref(q, k, v, **MASKS[mask])
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **MASKS[mask])
    assert_close_to_ref(out, out_ref, out_pt)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
def test_varlen_default_matches_reference_per_sequence(defaults, dtype, d, mask):
    from flash_attn.cute import flash_attn_varlen_func

    lens_q, lens_k = [1, 127, 129, 255], [128, 129, 1, 300]
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    torch.manual_seed(0)
    q = torch.randn(sum(lens_q), 4, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), 2, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lens_k), 2, d, device="cuda", dtype=dtype)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                 max_seqlen_k=max(lens_k), **MASKS[mask])
    out = out[0] if isinstance(out, tuple) else out
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        sl_q, sl_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        qi, ki, vi = q[sl_q][None], k[sl_k][None], v[sl_k][None]
        out_ref, _ = attention_ref(qi, ki, vi, **MASKS[mask])
        out_pt, _ = attention_ref(qi, ki, vi, upcast=False, reorder_ops=True, **MASKS[mask])
        assert_close_to_ref(out[sl_q][None], out_ref, out_pt, name=f"sequence {i} ({lq} x {lk})")


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk", SHAPES)
def test_learnable_sink_default_matches_reference(defaults, dtype, d, causal, sq, sk):
    from flash_attn.cute import flash_attn_func

    q, k, v = _qkv(1, sq, sk, 4, 4, d, d, dtype)
    sink = torch.randn(4, device="cuda", dtype=torch.float32)
    out = flash_attn_func(q, k, v, causal=causal, learnable_sink=sink)
    out = out[0] if isinstance(out, tuple) else out
    out_ref, _ = attention_ref(q, k, v, causal=causal, learnable_sink=sink)
    out_pt, _ = attention_ref(q, k, v, causal=causal, learnable_sink=sink, upcast=False, reorder_ops=True)
    assert_close_to_ref(out, out_ref, out_pt)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("sq,sk", [(127, 129), (129, 128), (255, 113), (77, 300)])
def test_gradients_default_match_reference(defaults, dtype, d, mask, sq, sk):
    """Whatever backward the default route picks (the cute kernel where it serves the call, else the next one)."""
    from flash_attn.cute import flash_attn_func

    q, k, v = _qkv(2, sq, sk, 4, 2, d, d, dtype, grad=True)
    out = flash_attn_func(q, k, v, **MASKS[mask])
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    out_ref, _ = attention_ref(q, k, v, **MASKS[mask])
    out_pt, _ = attention_ref(q, k, v, upcast=False, reorder_ops=True, **MASKS[mask])
    ref = torch.autograd.grad(out_ref, (q, k, v), g)
    pt = torch.autograd.grad(out_pt, (q, k, v), g)
    for name, got, r, p in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, pt):
        assert_close_to_ref(got, r, p, name=name)
