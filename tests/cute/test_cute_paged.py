"""Paged K / V in flash_attn.cute's varlen forward (page_table, as FA4's flash_attn_varlen_func takes it): k / v
(num_pages, page_size, Hk, D), sequence b's keys the first seqused_k[b] rows of its pages page_table[b, :] in
order. Each key block arrives as TMA boxes of min(page_size, block_n) rows from their pages. On the CPU: the block
and box rules, the config and cache key, whole calls with the kernel replaced by a torch model of its paged contract
against the reference per sequence (seqused_q too), the argument checks, and the paged kernels' PTX (one box per page
of a block, at its rows of the stage; ptxas clean). On a Hopper GPU (tests marked gpu): against the reference.

The paged kernel was written without a GPU (session 15) and its GPU tests here passed in session 16;
FLASH_ATTN_CUTE_DISABLE=paged turns page_table calls off (NotImplementedError; the dispatcher then serves them elsewhere)."""
import glob
import math
import os
import re
import sys

import pytest
import torch

pytest.importorskip("cutlass.cute")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PKG = os.path.join(ROOT, "packages", "flash-attn-4")
if _PKG not in sys.path:
    sys.path.insert(0, _PKG)

from flash_attn.cute import config, interface, kernels, launch  # noqa: E402
from _cute_table import swap_kernels as _swap_kernels  # noqa: E402
from flash_attn.testing import (  # noqa: E402
    assert_close_to_ref, assert_lse_close, assert_ptxas_clean, attention_lse_ref, attention_ref, fa4_window,
    paged_from_dense,
)
from flash_attn.testing import backend_fwd

I32 = torch.int32


@pytest.fixture(autouse=True)
def _defaults(cute_env):
    """No FLASH_ATTN_CUTE_OVERRIDES / FLASH_ATTN_CUTE_DISABLE: the default kernels."""



def test_paged_block_n():
    """The key block: the config's, or the largest multiple of 16 below it that a page divides or that divides a
    page; pages of a multiple of 8 rows only."""
    cases = {(128, 16): 128, (128, 256): 128, (128, 64): 128, (112, 16): 112, (112, 64): 64, (112, 256): 64,
             (80, 16): 80, (80, 64): 64, (80, 128): 64, (128, 48): 96, (128, 24): 96, (128, 8): 128,
             (96, 256): 64, (128, 200): None, (128, 12): None, (128, 4): None}
    for (block_n, page), want in cases.items():
        assert config.paged_block_n(block_n, page) == want, (block_n, page)


def test_paged_config():
    cfg = lambda d, causal, **kw: kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", **kw).key()  # noqa: E731
    for d in (64, 96, 128, 192, 256):
        for causal in (False, True):
            plain = cfg(d, causal, varlen=True)
            assert "paged" not in plain and cfg(d, causal, varlen=True, paged=0) == plain
            for page in (8, 16, 64, 256):
                paged = cfg(d, causal, varlen=True, paged=page)
                block_n = paged.get("block_n", 128)
                assert paged["paged"] == min(page, block_n) and (page % block_n == 0 or block_n % page == 0)
                assert {k: v for k, v in paged.items() if k not in ("paged", "block_n")} == \
                    {k: v for k, v in plain.items() if k != "block_n"}
                kernel = kernels._make_kernel(kernels.fwd_config(torch.bfloat16, d, causal, "sm_90a", varlen=True,
                                                                 paged=page))
                assert kernel.smem_bytes() <= kernel.SMEM_BYTES and kernel.paged == paged["paged"]
    with pytest.raises(NotImplementedError, match="page size 200"):
        cfg(128, True, varlen=True, paged=200)
    with pytest.raises(NotImplementedError, match="varlen"):
        cfg(128, True, paged=16)
    names = {kernels._entry(torch.bfloat16, 128, True, "sm_90a", varlen=True, paged=p)[2] for p in (0, 16, 256)}
    assert len(names) == 3 and any("-paged16-" in n for n in names)


def test_kernel_refuses_what_it_cannot_page():
    import cutlass

    from flash_attn.cute.flash_fwd_sm90 import FlashFwdSm90

    for kw, msg in [(dict(paged=16), "varlen only"), (dict(varlen=True, paged=12), "multiple of 8"),
                    (dict(varlen=True, paged=48), "divide block_n")]:
        with pytest.raises(ValueError, match=msg):
            FlashFwdSm90(cutlass.BFloat16, 128, True, **kw)


def test_split_unused_q_repeats_the_page_table_rows():
    table = torch.tensor([[3, 1], [0, 2]], dtype=I32)
    cu_q, pages, used_k = launch._split_unused_q(torch.tensor([0, 4, 9], dtype=I32), table,
                                                    torch.tensor([2, 5], dtype=I32), torch.tensor([30, 7], dtype=I32),
                                                    paged=True)
    assert cu_q.tolist() == [0, 2, 4, 9, 9] and used_k.tolist() == [30, 0, 7, 0]
    assert pages.tolist() == [[3, 1], [3, 1], [0, 2], [0, 2]]


def _paged_kernel_model(causal, sink_given):
    """The paged varlen kernel's contract in torch: sequence b = rows cu_q[b]:cu_q[b + 1] against the first
    used_k[b] rows of its pages (the page table comes where cu_seqlens_k goes)."""
    def run(q, k, v, out, lse, cu_q, page_table, used_k, max_seqlen_q, scale, softcap, wl, wr, *sink):
        sink = sink[0] if sink_given else None
        page_size = k.shape[1]
        for b in range(cu_q.shape[0] - 1):
            q0, q1, n = int(cu_q[b]), int(cu_q[b + 1]), int(used_k[b])
            if q1 == q0:
                continue
            if n == 0:
                out[q0:q1] = 0
                lse[:, q0:q1] = math.inf if sink is None else sink.view(-1, 1)
                continue
            pages = page_table[b, :-(-n // page_size)].long()
            ks, vs = k[pages].flatten(0, 1)[None, :n], v[pages].flatten(0, 1)[None, :n]
            qs = q[None, q0:q1]
            o, _ = attention_ref(qs, ks, vs, causal=causal, softmax_scale=scale, learnable_sink=sink)
            out[q0:q1] = o[0].to(out.dtype)
            lse[:, q0:q1] = attention_lse_ref(qs, ks, causal=causal, softmax_scale=scale, learnable_sink=sink)[0]
    return run


def _paged_case(lens_q, lens_k, page_size, heads, heads_kv, d, device="cpu", dtype=torch.float16, dv=None):
    """q packed, and k / v per sequence as dense (B, max Sk) scattered into a shuffled paged cache with spare pages."""
    torch.manual_seed(0)
    cu_q = torch.tensor([0] + lens_q).cumsum(0).to(device=device, dtype=I32)
    q = torch.randn(int(cu_q[-1]) + 2, heads, d, dtype=dtype, device=device)
    s_max = max(max(lens_k), 1)
    kd = torch.randn(len(lens_k), s_max, heads_kv, d, dtype=dtype, device=device)
    vd = torch.randn(len(lens_k), s_max, heads_kv, dv or d, dtype=dtype, device=device)
    pages_per = -(-s_max // page_size)
    num_pages = len(lens_k) * pages_per + 3
    k, table = paged_from_dense(kd, page_size, num_blocks=num_pages, generator=torch.Generator().manual_seed(1))
    v, _ = paged_from_dense(vd, page_size, block_table=table, num_blocks=num_pages)
    used_k = torch.tensor(lens_k, dtype=I32, device=device)
    return q, k, v, kd, vd, cu_q, table, used_k


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("with_used_q", [False, True])
def test_paged_calls_per_sequence(cute_env, monkeypatch, causal, sink, page_size, with_used_q):
    cute_env(DISABLE="pack_gqa")  # the unpacked paged kernel (plan.pack_gqa_auto=1 would pack these)
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    key = ((torch.float16, 64, causal, "sm_90a", False, False, True) + (("sink",) if sink else ())
           + ("paged", page_size))
    _swap_kernels(monkeypatch, {key: _paged_kernel_model(causal, sink)})
    lens_q, lens_k = [5, 0, 9, 3, 4], [20, 3, 9, 0, 16]
    used_q = [2, 0, 9, 3, 0] if with_used_q else lens_q
    q, k, v, kd, vd, cu_q, table, used_k = _paged_case(lens_q, lens_k, page_size, 4, 2, 64)
    sink_t = torch.randn(4) if sink else None
    out, lse = interface.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=None, seqused_q=torch.tensor(used_q, dtype=I32) if with_used_q else None, seqused_k=used_k,
        page_table=table, causal=causal, learnable_sink=sink_t, return_lse=True)
    for b in range(len(lens_q)):
        q0, uq, uk = int(cu_q[b]), used_q[b], lens_k[b]
        if uq and uk:
            qs, ks, vs = q[None, q0:q0 + uq], kd[b:b + 1, :uk], vd[b:b + 1, :uk]
            o_ref, _ = attention_ref(qs, ks, vs, causal=causal, learnable_sink=sink_t)
            o_pt, _ = attention_ref(qs, ks, vs, causal=causal, learnable_sink=sink_t, upcast=False, reorder_ops=True)
            assert_close_to_ref(out[None, q0:q0 + uq], o_ref, o_pt, name=f"sequence {b}")
            torch.testing.assert_close(lse[:, q0:q0 + uq],
                                       attention_lse_ref(qs, ks, causal=causal, learnable_sink=sink_t)[0])
        empty = slice(q0 + (uq if uk else 0), q0 + lens_q[b])
        assert torch.all(out[empty] == 0), b
    tail = int(cu_q[-1])
    assert torch.all(out[tail:] == 0) and torch.all(torch.isinf(lse[:, tail:]))


@pytest.mark.parametrize("table_on_host,on_lists", [(True, True), (False, True), (True, False)])
def test_paged_argument_checks(cute_env, monkeypatch, table_on_host, on_lists):
    # table_on_host: the page table travels to the host with the other values (small tables); else its entries are
    # checked on the device (tables past interface._HOST_PAGE_ENTRIES). on_lists: the small vectors checked on Python
    # lists (few sequences), else on the host tensor.
    monkeypatch.setattr(interface, "_HOST_PAGE_ENTRIES", 1 << 16 if table_on_host else 0)
    monkeypatch.setattr(interface, "_LIST_BATCH", 128 if on_lists else -1)
    monkeypatch.setattr(interface, "_LIST_PAGES", 256 if on_lists else -1)
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    q, k, v, _, _, cu_q, table, used_k = _paged_case([3, 4], [10, 17], 8, 2, 1, 64)
    call = lambda **kw: interface.flash_attn_varlen_func(  # noqa: E731
        q, kw.pop("k", k), kw.pop("v", v), cu_seqlens_q=cu_q, cu_seqlens_k=kw.pop("cu_k", None), seqused_k=kw.pop("used_k", used_k),
        page_table=kw.pop("table", table), **kw)
    cute_env(DISABLE="paged")
    with pytest.raises(NotImplementedError, match="^page_table: "):
        call()
    cute_env(DISABLE=None)
    cases = [
        (dict(k=k[0]), ValueError, "k must be a 4-D tensor"),
        (dict(cu_k=cu_q), ValueError, "seqused_k"),
        (dict(used_k=None), ValueError, "seqused_k"),
        (dict(table=table.long()), ValueError, "page_table must be an int32 tensor"),
        (dict(table=table[:1]), ValueError, "page_table must be an int32 tensor"),
        (dict(v=v[:, :, :, :12]), AssertionError, r"\(head_dim, head_dim_v\)=\(64, 12\) is not supported on SM90"),
        (dict(used_k=torch.tensor([10, 10 ** 4], dtype=I32)), ValueError, "seqused_k must lie in"),
        (dict(table=torch.where(table == table[1, 2], 10 ** 4, table)), ValueError, "1 entries that sequences use"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call(**kw)
    # an out-of-range entry past a sequence's pages is never read: no error (the kernel model is not called here)
    big = torch.cat([table, torch.full((2, 1), -7, dtype=I32)], 1)
    monkeypatch.setattr(interface, "forward_varlen", lambda *a, **kw: (q.new_zeros(q.shape), q.new_zeros(2, 9).float()))
    call(table=big)
    qg = q.clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="gradients with page_table"):
        interface.flash_attn_varlen_func(qg, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=None, seqused_k=used_k, page_table=table)
    # pages that fill no TMA box (12 rows here; FA4's tests use 1 and 4): gathered into contiguous keys for the
    # unpaged kernel, each sequence's page-table capacity in order
    seen = []
    monkeypatch.setattr(interface, "forward_varlen", lambda q_, k_, v_, cu_q_, cu_k_, used_k_, *a, page_table=None,
                        **kw: seen.append((k_.clone(), cu_k_.tolist(), used_k_.tolist(), page_table)) or (
                            q_.new_zeros(q_.shape), q_.new_zeros(q_.shape[1], q_.shape[0]).float()))
    k12 = torch.randn(k.shape[0], 12, *k.shape[2:], dtype=k.dtype)  # 12-row pages
    interface.flash_attn_varlen_func(q, k12, k12, cu_seqlens_q=cu_q, seqused_k=torch.tensor([10, 12], dtype=I32),
                                     page_table=table)
    (keys, cu_k, used, pages), = seen
    cap = table.shape[1] * 12
    assert pages is None and cu_k == [0, cap, 2 * cap] and used == [10, 12]
    for b in range(2):
        want = torch.cat([k12[int(p)] for p in table[b]])
        assert torch.equal(keys[b * cap:(b + 1) * cap], want)




def test_pages_bad_counts_the_used_entries_out_of_range(monkeypatch):
    """interface._pages_bad on Python lists (small tables) and on the tensor: the entries outside [0, num_pages) among
    each sequence's first ceil(used_k / page_size) pages, never the ones past them."""
    g = torch.Generator().manual_seed(1)
    for trial in range(20):
        B, P, ps, num_pages = 1 + trial % 4, 1 + trial % 7, (8, 16, 64)[trial % 3], 10
        table = torch.randint(-3, 14, (B, P), generator=g)
        used = torch.randint(0, P * ps + 1, (B,), generator=g)
        want = sum(int(not 0 <= int(table[b, j]) < num_pages) for b in range(B) for j in range(-(-int(used[b]) // ps)))
        for limit in (256, -1):
            monkeypatch.setattr(interface, "_LIST_PAGES", limit)
            assert interface._pages_bad(table, used, ps, num_pages) == want, (trial, limit)

def test_paged_value_checks_cost_one_copy(cute_env, monkeypatch):
    """A paged decoding call's value checks (cu_seqlens_q, seqused_k, the page table's used entries) dispatch no
    device op but the one concatenation of the small vectors and the page table and its copy to the host (each device
    op costs a launch per decoding step); the checks then run on the host copy."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append((str(func), (kwargs or {}).get("dtype")))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    monkeypatch.setattr(interface, "forward_varlen",
                        lambda q, *a, **kw: (q.new_zeros(q.shape), q.new_zeros(q.shape[1], q.shape[0]).float()))
    q, k, v, _, _, cu_q, table, used_k = _paged_case([3, 4], [10, 17], 8, 2, 1, 64)
    ops = []
    with Record():
        interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, seqused_k=used_k, page_table=table)
    copy = ops.index(("aten._to_copy.default", torch.int64))  # the values to the host (the call's one sync)
    assert [name for name, _ in ops[:copy]] == ["aten.view.default", "aten.cat.default"], ops[:copy]

def test_gathered_pages_keep_the_resolved_mask(cute_env, monkeypatch):
    """Pages that fill no TMA box go through a second call on gathered keys: it gets the mask as the first call
    resolved it (causal with a window is the window (left, 0)), not the caller's raw window with causal dropped
    (FA4's kvcache tests with 1- and 4-row pages, causal and local, caught that)."""
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    q, k, v, _, _, cu_q, table, used_k = _paged_case([3, 4], [10, 17], 8, 2, 1, 64)
    seen = []
    monkeypatch.setattr(interface, "forward_varlen", lambda q_, k_, v_, cu_q_, cu_k_, used_k_, max_q, scale, causal, arch,
                        left, right, softcap, **kw: seen.append((causal, left, right)) or (
                            q_.new_zeros(q_.shape), q_.new_zeros(q_.shape[1], q_.shape[0]).float()))
    k4 = torch.randn(k.shape[0], 4, *k.shape[2:], dtype=k.dtype)  # 4-row pages
    used = torch.tensor([3, 4], dtype=I32)
    for causal, window, want in ((True, (5, 3), (False, 5, 0)), (True, (None, None), (True, None, None)),
                                 (False, (5, 3), (False, 5, 3)), (True, (None, 7), (True, None, None))):
        seen.clear()
        interface.flash_attn_varlen_func(q, k4, k4, cu_seqlens_q=cu_q, seqused_k=used, page_table=table[:, :1],
                                         causal=causal, window_size=window)
        (c, left, right), = seen
        unbounded = lambda w: None if w >= interface._UNBOUNDED else w  # noqa: E731
        assert (c, unbounded(left), unbounded(right)) == want, (causal, window)


def test_paged_refusal_names_the_disable_variable(cute_env, monkeypatch):
    """With paged calls switched off, the FA4 API's NotImplementedError names the variable that did it."""
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    q, k, v, _, _, cu_q, table, used_k = _paged_case([3, 4], [10, 17], 8, 2, 1, 64)
    cute_env(DISABLE="paged")
    with pytest.raises(NotImplementedError, match="FLASH_ATTN_CUTE_DISABLE"):
        interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, seqused_k=used_k, page_table=table)


def test_root_dispatcher_routes_paged_calls_here(cute_env):
    """The root API's paged varlen forward (block_table) is served here unless FLASH_ATTN_CUTE_DISABLE names paged; its
    backward and ALiBi / dropout / probabilities go elsewhere."""
    from flash_attn.cute import backend
    from flash_attn.dispatch import Call

    call = Call(device_type="cuda", dtype=torch.bfloat16, head_dim=128, head_dim_v=128, arch=(9, 0), varlen=True,
                paged=True, causal=True)
    assert backend.unsupported_reason(call) is None
    cute_env(DISABLE="paged")
    assert "FLASH_ATTN_CUTE_DISABLE names paged" in backend.unsupported_reason(call)
    cute_env(DISABLE=None)
    assert backend.unsupported_reason(call._replace(window_left=8, softcap=30.0)) is None
    assert backend.unsupported_reason(call._replace(backward=True)) == "backward with paged KV"
    for what, kw in (("alibi", dict(alibi=True)), ("dropout", dict(dropout_p=0.1)), ("return_probs", dict(return_probs=True))):
        assert backend.unsupported_reason(call._replace(**kw)) == what


def test_backend_fwd_runs_paged_calls_per_sequence(monkeypatch):
    """backend.fwd (the root dispatcher's entry) with block_table: the paged kernel (its model) with each sequence's
    key count from cu_seqlens_k (cumulative, as the root API takes it), rows after the last sequence 0 / +inf; pages
    the kernel cannot box (12 rows) gathered for the unpaged kernel."""
    from flash_attn.cute import backend

    _swap_kernels(monkeypatch, {(torch.float16, 64, True, "sm_90a", False, False, True, "paged", 16):
                                _paged_kernel_model(True, False)})
    lens_q, lens_k = [5, 0, 9, 3], [20, 3, 9, 0]
    q, k, v, kd, vd, cu_q, table, _ = _paged_case(lens_q, lens_k, 16, 4, 2, 64)
    cu_k = torch.tensor([0] + lens_k).cumsum(0).to(I32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=9, max_seqlen_k=20, softmax_scale=0.125,
              causal=True, window_left=-1, window_right=0, softcap=0.0, alibi_slopes=None, dropout_p=0.0,
              rng_state=None, return_probs=False)
    out, lse, _ = backend_fwd(backend, q, k, v, block_table=table, **kw)
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        q0 = int(cu_q[b])
        if sq and sk:
            qs, ks, vs = q[None, q0:q0 + sq], kd[b:b + 1, :sk], vd[b:b + 1, :sk]
            o_ref, _ = attention_ref(qs, ks, vs, causal=True, softmax_scale=0.125)
            o_pt, _ = attention_ref(qs, ks, vs, causal=True, softmax_scale=0.125, upcast=False, reorder_ops=True)
            assert_close_to_ref(out[None, q0:q0 + sq], o_ref, o_pt, name=f"sequence {b}")
            torch.testing.assert_close(lse[:, q0:q0 + sq],
                                       attention_lse_ref(qs, ks, causal=True, softmax_scale=0.125)[0])
        elif sq:
            assert torch.all(out[q0:q0 + sq] == 0)
    tail = int(cu_q[-1])
    assert torch.all(out[tail:] == 0) and torch.all(torch.isposinf(lse[:, tail:]))
    # pages the kernel cannot box (12 rows): gathered into contiguous keys for the unpaged varlen kernel
    q, k, v, _, _, cu_q, table, _ = _paged_case(lens_q, lens_k, 12, 4, 2, 64)
    seen = []
    monkeypatch.setattr(launch, "forward_varlen", lambda q_, k_, v_, cu_q_, cu_k_, used_k_, *a, page_table=None,
                        **kw_: seen.append((k_, cu_k_.tolist(), used_k_.tolist(), page_table)) or (
                            q_.new_zeros(q_.shape), q_.new_zeros(q_.shape[1], q_.shape[0]).float()))
    backend_fwd(backend, q, k, v, block_table=table, **kw)
    (keys, cu, used, pages), = seen
    cap = table.shape[1] * 12
    assert pages is None and cu == [cap * b for b in range(5)] and used == lens_k
    for b in range(4):
        assert torch.equal(keys[b * cap:(b + 1) * cap], torch.cat([k[int(p)] for p in table[b]]))


@pytest.mark.parametrize("page_size", [16, 256])
def test_paged_kernel_loads_k_and_v_by_page(tmp_path, page_size):
    """K and V go through 4-D TMA descriptors (page rows, D, KV heads, pages: the page is a coordinate), one copy per
    swizzle column block in the block's loop over its boxes (8 boxes of 16-row pages; one box of 128 rows of a
    256-row page), Q through varlen's 3-D one; the kernel is ptxas clean (the producer's 24 registers included)."""
    kernels.compile_fwd(torch.bfloat16, 128, True, dump_dir=str(tmp_path), varlen=True, paged=page_size)
    (ptx,) = glob.glob(str(tmp_path / "*.ptx"))
    text = open(ptx).read()
    dims = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.shared::cta\.global", text)
    assert dims == ["3", "3", "4", "4", "4", "4"]
    assert_ptxas_clean(ptx)


# ----------------------------------------------------------------------------------------------------
# GPU


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# The GPU test's cases (gpu_kernel_requests() reads them too, for benchmarks/tools/precompile_gpu_tests.py): every head dim
# (and 192 / 128) with pages of 16 (several boxes per key block) and 256 rows, plain and causal; d128 with 64-row
# pages and the sink, pack_gqa and a window as well.
_PLAIN = [(False, (-1, -1), False, False), (True, (-1, -1), False, False)]  # (causal, window, sink, pack)
_MORE = [(True, (-1, -1), True, True), (False, (40, 8), False, True)]
_GPU_CASES = ([(d, dv, page, *opt) for d, dv in [(64, 64), (128, 128), (256, 256), (192, 128)] for page in (16, 256)
               for opt in _PLAIN]
              + [(128, 128, page, *opt) for page in (16, 64, 256) for opt in _MORE]
              + [(128, 128, 64, *opt) for opt in _PLAIN])


def gpu_kernel_requests():
    """The forward calls' kernel choices of this file's GPU tests, for benchmarks/tools/precompile_gpu_tests.py."""
    return ([dict(dtype=torch.bfloat16, d=d, dv=dv, causal=c, window=w, sink=sink, pack=4 if pack else 1,
                  varlen=True, paged=page) for d, dv, page, c, w, sink, pack in _GPU_CASES]
            + [dict(dtype=torch.bfloat16, d=128, causal=c, varlen=True, paged=64) for c in (False, True)])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("d,dv,page_size,causal,window,sink,pack", _GPU_CASES)
def test_paged_matches_reference_per_sequence_on_gpu(monkeypatch, d, dv, page_size, causal, window, sink, pack):
    from flash_attn.cute import flash_attn_varlen_func

    # (no FLASH_ATTN_CUTE_DISABLE: paged, hdim_v and pack_gqa on)
    _swap_kernels(monkeypatch, {})  # the kernels this call runs, loaded anew from the disk cache
    heads, heads_kv = 8, 2
    lens_q, lens_k = [1, 0, 77, 1, 300, 5], [500, 9, 77, 0, 300, 1000]
    q, k, v, kd, vd, cu_q, table, used_k = _paged_case(lens_q, lens_k, page_size, heads, heads_kv, d, "cuda",
                                                       torch.bfloat16, dv)
    sink_t = torch.randn(heads, device="cuda") if sink else None
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=None, seqused_k=used_k, page_table=table, causal=causal,
                                      window_size=fa4_window(window), learnable_sink=sink_t, pack_gqa=pack, return_lse=True)
    torch.cuda.synchronize()
    assert any(key[-2:] == ("paged", page_size) for key in kernels._kernels)
    ref_window = (window[0], 0 if causal else window[1])
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        q0 = int(cu_q[b])
        if sq == 0:
            continue
        if sk == 0:
            assert torch.all(out[q0:q0 + sq] == 0)
            continue
        qs, ks, vs = q[None, q0:q0 + sq], kd[b:b + 1, :sk], vd[b:b + 1, :sk]
        kw = dict(causal=causal, window_size=ref_window, learnable_sink=sink_t)
        o_ref, _ = attention_ref(qs, ks, vs, **kw)
        o_pt, _ = attention_ref(qs, ks, vs, upcast=False, reorder_ops=True, **kw)
        assert_close_to_ref(out[None, q0:q0 + sq], o_ref, o_pt, name=f"sequence {b}")
        lse_ref = attention_lse_ref(qs, ks, causal=causal, window_size=ref_window, learnable_sink=sink_t)[0]
        assert_lse_close(lse[:, q0:q0 + sq], lse_ref, name=f"lse of sequence {b}")


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm_90) GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_root_api_paged_calls_run_here_on_gpu(monkeypatch, causal):
    """flash_attn.flash_attn_varlen_func(..., block_table=...) (FA2's paged call: cu_seqlens_k counts each
    sequence's keys) runs the paged kernel through the root dispatcher, against the reference per sequence."""
    import flash_attn
    from flash_attn import dispatch

    monkeypatch.setattr(dispatch, "_choice", {})  # (the dispatcher's choices are cached per kind of call)
    _swap_kernels(monkeypatch, {})  # the kernels this call runs, loaded anew from the disk cache
    heads, heads_kv, d, page = 8, 2, 128, 64
    lens_q, lens_k = [1, 77, 300, 5], [500, 77, 300, 1000]
    q, k, v, kd, vd, cu_q, table, _ = _paged_case(lens_q, lens_k, page, heads, heads_kv, d, "cuda", torch.bfloat16)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(I32)
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                            block_table=table)
    torch.cuda.synchronize()
    assert any(key[-2:] == ("paged", page) for key in kernels._kernels)
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        q0 = int(cu_q[b])
        qs, ks, vs = q[None, q0:q0 + sq], kd[b:b + 1, :sk], vd[b:b + 1, :sk]
        o_ref, _ = attention_ref(qs, ks, vs, causal=causal)
        o_pt, _ = attention_ref(qs, ks, vs, causal=causal, upcast=False, reorder_ops=True)
        assert_close_to_ref(out[None, q0:q0 + sq], o_ref, o_pt, name=f"sequence {b}")
