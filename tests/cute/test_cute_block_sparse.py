"""Block sparsity in flash_attn.cute (FA4's block_sparse_tensors; block_sparsity.py host side, sparse_tiles.py in the
Hopper forward): the checks and shapes on the CPU, FlexAttention's BlockMask as input, the kernel compiled for
sm_90a; on a Hopper GPU the outputs against an fp32 reference that visits the same blocks, and against
torch.compile'd flex_attention with the same BlockMask."""
import glob
import os
import shutil

import pytest
import torch

pytest.importorskip("cutlass")

import _cute_mods as m  # noqa: E402
from flash_attn.testing import assert_ptxas_clean  # noqa: E402
from flash_attn.cute import block_sparsity as bs  # noqa: E402
from flash_attn.cute import interface, mods  # noqa: E402
from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: E402

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a Hopper (sm_90) GPU")
CPU = torch.device("cpu")


def _lists(B, H, M, N, pattern, full=None):
    """BlockSparseTensorsTorch from bool (B, H, M, N) partial-block pattern (and full pattern, or None); ascending
    indices packed left (as FlexAttention's)."""
    def pack(p):
        cnt = p.sum(-1).to(torch.int32)
        order = torch.sort((~p).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
        return cnt, order
    mc, mi = pack(pattern)
    fc = fi = None
    if full is not None:
        fc, fi = pack(full)
    return BlockSparseTensorsTorch(mc, mi, fc, fi)


# --- host side: checks and shapes ----------------------------------------------------------------------------

def test_normalize_keeps_full_and_shared_dims():
    p = torch.zeros(1, 1, 2, 3, dtype=torch.bool)
    p[..., 0] = True
    t = _lists(1, 1, 2, 3, p, full=~p)._replace(block_size=(128, 128))
    call = bs.normalize(t, 4, 8, 256, 300, 128, 128, CPU)
    assert [x.shape for x in call.tensors] == [(1, 1, 2), (1, 1, 2, 3), (1, 1, 2), (1, 1, 2, 3)]
    assert call.spec == (True, 1, 1) and call.block_n == 128


def test_normalize_reads_an_expanded_dim_once_and_materialises_mixed():
    p = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    t = _lists(1, 1, 2, 2, p)
    exp = BlockSparseTensorsTorch(t.mask_block_cnt.expand(3, 4, 2), t.mask_block_idx.expand(3, 4, 2, 2))
    call = bs.normalize(exp._replace(block_size=(128, 128)), 3, 4, 256, 256, 128, 128, CPU)
    assert [x.shape[:2] for x in call.tensors] == [(1, 1), (1, 1)]
    # counts per head, indices shared: the indices become per head (one (Bs, Hs) for the kernel)
    mixed = BlockSparseTensorsTorch(t.mask_block_cnt.expand(1, 4, 2).contiguous(), t.mask_block_idx,
                                    block_size=(128, 128))
    call = bs.normalize(mixed, 3, 4, 256, 256, 128, 128, CPU)
    assert [tuple(x.shape) for x in call.tensors] == [(1, 4, 2), (1, 4, 2, 2)]
    assert all(0 not in x.stride() for x in call.tensors)


def test_query_blocks_of_an_odd_number_of_64_rows_take_the_64_row_tile():
    t = _lists(1, 1, 4, 2, torch.ones(1, 1, 4, 2, dtype=torch.bool))
    call = bs.normalize(t._replace(block_size=(64, 128)), 1, 1, 256, 256, 128, 128, CPU)
    assert (call.block_m, call.q_factor, call.kv_factor) == (64, 1, 1)
    t = _lists(1, 1, 2, 2, torch.ones(1, 1, 2, 2, dtype=torch.bool))
    call = bs.normalize(t._replace(block_size=(192, 128)), 1, 1, 384, 256, 128, 128, CPU)
    assert (call.block_m, call.q_factor) == (64, 3)
    call = bs.normalize(t._replace(block_size=(256, 128)), 1, 1, 512, 256, 128, 128, CPU)
    assert (call.block_m, call.q_factor) == (128, 2)


def test_one_warpgroup_sparse_kernel_compiles_without_spills(tmp_path):
    mods.compile_fwd_mods(torch.bfloat16, 128, False, arch="sm_90a", dump_dir=str(tmp_path), mask_mod=m.window_mask,
                          sparse=(True, 3, 1), block_m=64)
    ptx, = glob.glob(os.path.join(tmp_path, "**", "*.ptx"), recursive=True)
    text = open(ptx).read()
    assert ".reqntid 256, 1, 1" in text and "wgmma.mma_async.sync.aligned.m64n" in text  # one consumer warpgroup
    if shutil.which("ptxas"):
        assert_ptxas_clean(ptx)


def test_sparse_blocks_larger_than_the_tiles_give_factors():
    p = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    t = _lists(1, 1, 2, 2, p)._replace(block_size=(256, 256))
    call = bs.normalize(t, 1, 1, 512, 512, 128, 128, CPU)
    assert (call.q_factor, call.kv_factor, call.block_n) == (2, 2, 128)
    # d256's key block 80 does not divide 128: the kernel takes 64
    call = bs.normalize(t._replace(block_size=(256, 128)), 1, 1, 512, 256, 128, 80, CPU)
    assert (call.block_n, call.kv_factor) == (64, 2)
    assert bs.kernel_block_n(None, 80) == 80 and bs.kernel_block_n(160, 80) == 80


def test_query_block_inferred_only_when_unambiguous():
    t = _lists(1, 1, 3, 1, torch.ones(1, 1, 3, 1, dtype=torch.bool))
    assert bs.sparse_block_size(t, 384, 128) == (128, None)  # 128..191 give 3 blocks: 128 is the one multiple
    assert bs.sparse_block_size(t, 640, 128) == (256, None)  # 214..319
    assert bs.sparse_block_size(t, 300, 128) == (128, None)  # 100..149
    with pytest.raises(ValueError, match="none"):
        bs.sparse_block_size(t, 200, 128)  # 67..99
    two = _lists(1, 1, 2, 1, torch.ones(1, 1, 2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\[1024, 1152"):
        bs.sparse_block_size(two, 2000, 128)  # 1000..1999: several
    one = _lists(1, 1, 1, 1, torch.ones(1, 1, 1, 1, dtype=torch.bool))
    assert bs.sparse_block_size(one, 300, 128) == (384, None)  # one block covers any length
    call = bs.normalize(t._replace(block_size=(128, 128)), 1, 1, 300, 100, 128, 128, CPU)
    assert call.q_factor == 1


@pytest.mark.parametrize("change, err, match", [
    (dict(mask_block_cnt=torch.zeros(1, 1, 2, dtype=torch.int64)), ValueError, "int32"),
    (dict(mask_block_idx=torch.zeros(1, 1, 2, dtype=torch.int32)), ValueError, r"\(B, H, M, N\)"),
    (dict(mask_block_cnt=torch.zeros(2, 1, 2, dtype=torch.int32)), ValueError, "batch / head dims"),
    (dict(mask_block_cnt=torch.zeros(1, 1, 3, dtype=torch.int32)), ValueError, "3 query blocks, expected 2"),
    (dict(mask_block_idx=torch.zeros(1, 1, 2, 4, dtype=torch.int32)), ValueError, "at most 2"),
    (dict(full_block_cnt=torch.zeros(1, 1, 2, dtype=torch.int32)), ValueError, "both be given"),
    (dict(block_size=(96, 128)), NotImplementedError, "query sparse_block_size 96 must be a multiple of 128 .*not "
                                                       "implemented yet"),
    (dict(block_size=(100, 128)), ValueError, r"query sparse_block_size 100 must be a multiple of 128 \(the kernel's "
                                              r"query tile\)$"),
    (dict(block_size=(128, 100)), ValueError, "multiple of 16"),
    (dict(cu_total_m_blocks=torch.zeros(2, dtype=torch.int32)), ValueError, "belong to a varlen call"),
])
def test_inconsistent_tensors_raise_naming_the_field(change, err, match):
    t = _lists(1, 1, 2, 2, torch.ones(1, 1, 2, 2, dtype=torch.bool))._replace(block_size=(128, 128))
    with pytest.raises(err, match=match):
        bs.normalize(t._replace(**change), 3, 4, 256, 256, 128, 128, CPU)


def test_backward_lists_name_the_side_of_a_bad_block_size():
    """normalize_bwd's lists have key blocks as rows: a bad query block size is still called the query's (FA4's
    tests match 'sparse_block_size')."""
    t = _lists(1, 1, 2, 2, torch.ones(1, 1, 2, 2, dtype=torch.bool))._replace(block_size=(100, 128))
    with pytest.raises(ValueError, match="the query sparse_block_size 100 must be a multiple of 64"):
        bs.normalize_bwd(t, 1, 1, 200, 256, 64, 128, CPU)


def _packed_varlen(kind, num_m, num_n, offsets=True):
    """FA4's packed varlen lists of per-sequence (H, M_b, N_b) tile kinds (0 skip, 1 partial, 2 full), built
    directly by their definition: counts (H, total_m), indices (H, total_n) at cu_block_idx_offsets[b] + m * N_b."""
    from flash_attn.cute.compute_block_sparsity import pack_kinds

    H = kind[0].shape[0]
    cu_m = [0]
    cu_n = [0]
    cnt = {"mask": [], "full": []}
    idx = {"mask": [], "full": []}
    for k_b, M_b, N_b in zip(kind, num_m, num_n):
        lists = pack_kinds(k_b[None])
        for name, (c, i) in (("mask", lists[:2]), ("full", lists[2:4])):
            cnt[name].append(c[0])
            idx[name].append(i[0].reshape(H, M_b * N_b))
        cu_m.append(cu_m[-1] + M_b)
        cu_n.append(cu_n[-1] + M_b * N_b)
    cat = {n: (torch.cat(cnt[n], 1), torch.cat(idx[n], 1)) for n in cnt}
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return BlockSparseTensorsTorch(*cat["mask"], *cat["full"], cu_total_m_blocks=i32(cu_m),
                                   cu_block_idx_offsets=i32(cu_n) if offsets else None)


def test_varlen_lists_are_laid_out_per_sequence():
    """FA4's packed varlen lists become (batch, H, M, N) rows per sequence and query block: the same pairs as the
    sequences' own lists; shorter sequences' rows padded with count 0."""
    g = torch.Generator().manual_seed(3)
    seq_q, seq_k = [300, 1, 128], [200, 700, 128]
    num_m = [-(-s // 128) for s in seq_q]
    num_n = [-(-s // 128) for s in seq_k]
    H = 2
    kind = [torch.randint(0, 3, (H, M_b, N_b), generator=g, dtype=torch.int32) for M_b, N_b in zip(num_m, num_n)]
    t = _packed_varlen(kind, num_m, num_n)._replace(block_size=(128, 128))
    call = bs.normalize_varlen(t, 3, H, max(seq_q), max(seq_k), 128, 128, CPU)
    assert call.spec == (True, 1, 1) and call.tensors[0].shape == (3, H, 3)
    for b, (k_b, M_b, N_b) in enumerate(zip(kind, num_m, num_n)):
        one = BlockSparseTensorsTorch(*(x[b:b + 1] for x in call.tensors))
        seen, partial = bs.visited(one, 1, H, max(seq_q), max(seq_k), (128, 128))
        want = k_b.repeat_interleave(128, 1).repeat_interleave(128, 2)
        want = torch.nn.functional.pad(want, (0, 6 * 128 - want.shape[2], 0, 3 * 128 - want.shape[1]))
        want = want[:, :max(seq_q), :max(seq_k)]
        assert torch.equal(seen[0], want > 0) and torch.equal(partial[0], want == 1), b
    # the uniform-keys form (no cu_block_idx_offsets): every sequence has the call's key blocks
    kind = [torch.randint(0, 3, (H, M_b, 2), generator=g, dtype=torch.int32) for M_b in num_m]
    t = _packed_varlen(kind, num_m, [2, 2, 2], offsets=False)._replace(block_size=(128, 128))
    call = bs.normalize_varlen(t, 3, H, max(seq_q), 256, 128, 128, CPU)
    for b, k_b in enumerate(kind):
        assert torch.equal(call.tensors[0][b, :, :num_m[b]], (k_b == 1).sum(-1, dtype=torch.int32))
        assert torch.equal(call.tensors[2][b, :, :num_m[b]], (k_b == 2).sum(-1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"int32 \(H, total\)"):
        bs.normalize_varlen(t._replace(mask_block_cnt=t.mask_block_cnt[None]), 3, H, 300, 256, 128, 128, CPU)
    with pytest.raises(ValueError, match=r"cu_total_m_blocks must be an int32 tensor of shape \(4,\)"):
        bs.normalize_varlen(t._replace(cu_total_m_blocks=t.cu_total_m_blocks[:3]), 3, H, 300, 256, 128, 128, CPU)


def test_varlen_sparse_kernel_compiles(tmp_path):
    mods.compile_fwd_mods(torch.bfloat16, 128, False, arch="sm_90a", dump_dir=str(tmp_path), varlen=True,
                          mask_mod=m.document_mask, spec=((torch.int32, 2),), sparse=(True, 1, 1))
    ptx, = glob.glob(os.path.join(tmp_path, "**", "*.ptx"), recursive=True)
    assert "wgmma.mma_async" in open(ptx).read()


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("offsets", [True, False])
@pytest.mark.parametrize("mask", [None, "window"])
def test_varlen_block_sparsity_matches_the_reference(cute_env, offsets, mask):
    """flash_attn_varlen_func with FA4's packed lists: each sequence attends exactly its listed pairs (the mask_mod
    on the partial blocks only), as the sequence alone would."""
    cute_env()
    torch.manual_seed(9)
    g = torch.Generator().manual_seed(10)
    seq_q = [300, 1, 128, 517]
    seq_k = [200, 700, 128, 517] if offsets else [384] * 4
    num_m = [-(-s // 128) for s in seq_q]
    num_n = [-(-s // 128) for s in seq_k]
    H, Hk, d = 4, 2, 128
    kind = [torch.randint(0, 3, (H, M_b, N_b), generator=g, dtype=torch.int32) for M_b, N_b in zip(num_m, num_n)]
    lists = _packed_varlen(kind, num_m, num_n, offsets)._replace(block_size=(128, 128))
    lists = BlockSparseTensorsTorch(*(x.cuda() if isinstance(x, torch.Tensor) else x for x in lists))
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,  # noqa: E731
                                   device="cuda")
    q = torch.randn(sum(seq_q), H, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(seq_k), Hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fn = m.window_mask if mask else None
    out = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu(seq_q), cu_seqlens_k=cu(seq_k), mask_mod=fn,
                                           block_sparse_tensors=lists)[0]
    for b in range(len(seq_q)):
        qs, ks = sum(seq_q[:b]), sum(seq_k[:b])
        qb, kb, vb = (t[None, s:s + n] for t, s, n in ((q, qs, seq_q[b]), (k, ks, seq_k[b]), (v, ks, seq_k[b])))
        want = kind[b].repeat_interleave(128, 1).repeat_interleave(128, 2)[None, :, :seq_q[b], :seq_k[b]].cuda()
        keep = m.window_mask_torch(seq_q[b], seq_k[b], "cuda") if mask else None
        ref = _reference(qb, kb, vb, d ** -0.5, want > 0, want == 1, mask_fn=keep)
        ref_lp = _reference(qb, kb, vb, d ** -0.5, want > 0, want == 1, mask_fn=keep, dtype=torch.bfloat16)
        m.assert_close_to_oracle((out[None, qs:qs + seq_q[b]],), (ref,), (ref_lp,), names="o", where=(b,))


def test_varlen_block_sparsity_refuses_gradients(cute_env, monkeypatch):
    cute_env()
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    q = torch.randn(14, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)
    t = _lists(1, 1, 1, 1, torch.ones(1, 1, 1, 1, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="varlen backward with block sparsity"):
        interface.flash_attn_varlen_func(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, block_sparse_tensors=t)


def test_tensors_on_another_device_raise():
    t = _lists(1, 1, 2, 2, torch.ones(1, 1, 2, 2, dtype=torch.bool))._replace(block_size=(128, 128))
    with pytest.raises(ValueError, match="must be on meta"):
        bs.normalize(t, 1, 1, 256, 256, 128, 128, torch.device("meta"))


def test_flex_block_mask_gives_the_same_lists():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")

    def doc_causal(b, h, q, k):
        return (q >= k) & (q // 200 == k // 200)

    Sq = Sk = 520
    bm = fa.create_block_mask(doc_causal, 2, 1, Sq, Sk, device="cpu", BLOCK_SIZE=128)
    t = bs.from_block_mask(bm)
    assert t.block_size == (128, 128)
    seen, partial = bs.visited(t, 2, 3, Sq, Sk, t.block_size)
    assert seen.shape == (2, 3, Sq, Sk)
    q = torch.arange(Sq)[:, None]
    k = torch.arange(Sk)[None, :]
    keep = doc_causal(0, 0, q, k)
    assert bool((seen | ~keep).all())  # every kept score is in a visited block
    assert not bool((keep & ~seen).any())
    full = seen & ~partial
    assert bool(keep[full[0, 0]].all())  # full blocks need no mask
    dense = bm.to_dense()  # FlexAttention's own block view: visited blocks
    assert torch.equal(seen[0, 0, ::128, ::128], dense[0, 0].bool())
    bs.check_values(t, Sk)


def test_check_values_finds_bad_indices_and_repeats():
    p = torch.zeros(1, 1, 2, 3, dtype=torch.bool)
    p[..., :2] = True
    t = _lists(1, 1, 2, 3, p)._replace(block_size=(128, 128))
    bs.check_values(t, 384)
    p3 = torch.ones(1, 1, 2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        bs.check_values(_lists(1, 1, 2, 3, p3)._replace(block_size=(128, 128)), 256)  # block 2 of 2
    bad = t._replace(mask_block_idx=torch.full_like(t.mask_block_idx, 5))
    with pytest.raises(ValueError, match="indices"):
        bs.check_values(bad, 384)
    twice = t._replace(full_block_cnt=t.mask_block_cnt, full_block_idx=t.mask_block_idx)
    with pytest.raises(ValueError, match="twice"):
        bs.check_values(twice, 384)
    with pytest.raises(ValueError, match="counts"):
        bs.check_values(t._replace(mask_block_cnt=t.mask_block_cnt + 9), 384)


# --- the API ---------------------------------------------------------------------------------------------------

def _qkv(B=2, S=7, d=64):
    q = torch.randn(B, S, 4, d, dtype=torch.bfloat16)
    k = torch.randn(B, S, 2, d, dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


@pytest.fixture
def defaults(cute_env):
    cute_env()


def test_api_passes_the_tensors_to_the_mod_launch(defaults, monkeypatch):
    seen = []
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")

    def dense(q, k, v, scale, causal, arch, wl, wr, score_mod, mask_mod, aux, block_sparse=None, aux_scalars=None,
              sink=None):
        seen.append((score_mod, mask_mod, block_sparse, causal))
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(mods, "forward", dense)
    q, k, v = _qkv()
    t = _lists(1, 1, 1, 1, torch.ones(1, 1, 1, 1, dtype=torch.bool))
    interface.flash_attn_func(q, k, v, block_sparse_tensors=t, causal=True)  # sparsity alone, with causal
    interface.flash_attn_func(q, k, v, mask_mod=m.causal_mask, block_sparse_tensors=t)
    assert seen == [(None, None, t, True), (None, m.causal_mask, t, False)]
    from flash_attn.cute.interface import _flash_attn_fwd
    _flash_attn_fwd(q, k, v, mask_mod=m.causal_mask, block_sparse_tensors=t)
    assert seen[-1][1:3] == (m.causal_mask, t)


def test_api_refuses_what_is_not_served(defaults, monkeypatch):
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    q, k, v = _qkv()
    t = _lists(1, 1, 1, 1, torch.ones(1, 1, 1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="without block_sparse_tensors"):
        interface.flash_attn_func(q, k, v, block_sparse_tensors_bwd=t)
    q.requires_grad_(True)
    with pytest.raises(ValueError, match="needs block_sparse_tensors_bwd"):
        interface.flash_attn_func(q, k, v, block_sparse_tensors=t)
    with pytest.raises(NotImplementedError, match="window_size"):
        interface.flash_attn_func(q, k, v, block_sparse_tensors=t, block_sparse_tensors_bwd=t, window_size=(8, 8))
    with pytest.raises(ValueError, match="softcap and score_mod"):
        interface.flash_attn_func(q.detach(), k, v, score_mod=m.identity, softcap=5.0)


def test_softcap_with_mask_mod_or_sparsity_runs_as_the_softcap_score_mod(defaults, monkeypatch):
    """softcap with a mask_mod or block sparsity (FA4 turns softcap into a score_mod): the mod kernels get
    mod_library.softcap's pair (one function per cap: one kernel), forward, varlen forward and the backward's
    score_mod_bwd; the native softcap is not passed on."""
    from flash_attn.cute import launch, lowlevel, mod_library

    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    monkeypatch.setattr(launch, "_device_arch", lambda q, k, v: "sm_90a")
    capped = mod_library.softcap(5.0)
    seen = []
    monkeypatch.setattr(mods, "forward", lambda q, k, v, scale, causal, arch, wl, wr, score_mod, mask_mod, *a, **kw:
                        seen.append((score_mod, mask_mod)) or (torch.zeros_like(q),
                                                               torch.zeros(q.shape[0], q.shape[2], q.shape[1])))
    q, k, v = _qkv()
    t = _lists(1, 1, 1, 1, torch.ones(1, 1, 1, 1, dtype=torch.bool))
    interface.flash_attn_func(q, k, v, block_sparse_tensors=t, softcap=5.0)
    interface.flash_attn_func(q, k, v, mask_mod=m.causal_mask, softcap=5.0)
    assert seen == [(capped.score_mod, None), (capped.score_mod, m.causal_mask)]
    monkeypatch.setattr(mods, "forward_varlen", lambda q, k, v, cu_q, cu_k, used_k, max_q, scale, causal, arch, wl,
                        wr, score_mod, mask_mod, *a, **kw: seen.append((score_mod, mask_mod))
                        or (torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])))
    cu = torch.tensor([0, q.shape[1]], dtype=torch.int32)
    interface.flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, mask_mod=m.causal_mask,
                                     softcap=5.0)
    assert seen[-1] == (capped.score_mod, m.causal_mask)
    grads = []
    monkeypatch.setattr(mods, "backward", lambda dout, q, k, v, out, lse, dlse, scale, arch, score_mod, score_mod_bwd,
                        *a: grads.append((score_mod, score_mod_bwd)) or (q, k, v))
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    lowlevel._flash_attn_bwd(q, k, v, q, q, lse, mask_mod=m.causal_mask, softcap=5.0)
    assert grads == [(capped.score_mod, capped.score_mod_bwd)]


# --- the kernel, compiled for sm_90a on the CPU ------------------------------------------------------------------

@pytest.fixture(scope="module")
def sparse_ptx(tmp_path_factory):
    dump = tmp_path_factory.mktemp("sparseptx")
    mods.compile_fwd_mods(torch.bfloat16, 128, False, arch="sm_90a", dump_dir=str(dump), mask_mod=m.document_mask,
                          spec=((torch.int32, 2),), sparse=(True, 1, 2))
    paths = glob.glob(os.path.join(dump, "**", "*.ptx"), recursive=True)
    assert len(paths) == 1, paths
    return paths[0]


def test_sparse_kernel_compiles_and_reads_the_lists(sparse_ptx):
    text = open(sparse_ptx).read()
    assert ".target sm_90a" in text and "wgmma.mma_async" in text
    # the lists are the kernel's last tensor arguments: their loads are 32-bit global loads
    assert text.count("ld.global.u32") + text.count("ld.global.s32") + text.count("ld.global.b32") >= 4


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas not on PATH")
def test_sparse_kernel_does_not_spill(sparse_ptx):
    assert_ptxas_clean(sparse_ptx)


def test_kernels_are_keyed_by_the_sparsity(monkeypatch):
    built = []
    monkeypatch.setattr(mods, "compile_fwd_mods", lambda *a, **kw: built.append(kw) or object())
    from flash_attn.cute import kernels
    monkeypatch.setattr(kernels, "_tvm_ffi", lambda: True)
    monkeypatch.setattr(kernels, "_ffi_function", lambda f: f)
    monkeypatch.setattr(mods, "_mod_kernels", {})
    args = (torch.bfloat16, 128, False, "sm_90a", False, False, None, m.causal_mask, ())
    a = mods.mod_kernel(*args)
    b = mods.mod_kernel(*args, (True, 1, 1), 128)
    c = mods.mod_kernel(*args, (True, 1, 2), 128)
    d = mods.mod_kernel(*args, (True, 1, 2), 64)
    assert len({id(x) for x in (a, b, c, d)}) == 4 and len(built) == 4
    assert mods.mod_kernel(*args, (True, 1, 2), 64) is d and len(built) == 4
    assert built[1]["sparse"] == (True, 1, 1) and built[3]["block_n"] == 64


# --- GPU: against an fp32 attention over the same blocks -----------------------------------------------------------

def _reference(q, k, v, scale, seen, partial, score_fn=None, mask_fn=None, aux=None, causal=False, dtype=torch.float32):
    """Attention in ``dtype`` over the visited keys (seen (B, H, Sq, Sk)), the mask_mod's mask (bool (B or 1, 1,
    Sq, Sk)) on the partial blocks only; rows with no key give 0. Returns fp32 (B, Sq, H, D)."""
    g = q.shape[2] // k.shape[2]
    qf = q.to(dtype).transpose(1, 2)
    kf = k.to(dtype).repeat_interleave(g, dim=2).transpose(1, 2)
    vf = v.to(dtype).repeat_interleave(g, dim=2).transpose(1, 2)
    s = qf @ kf.transpose(-1, -2) * scale
    if score_fn is not None:
        s = score_fn(s, aux).to(dtype)
    keep = seen
    if mask_fn is not None:
        keep = keep & (~partial | mask_fn)
    if causal:
        keep = keep & m.causal_mask_torch(s.shape[-2], s.shape[-1], s.device)
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2).float()


def _random_lists(B, H, M, N, device, full=True, compact=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    kind = torch.randint(0, 3, (B, H, M, N), generator=g)  # 0 skip, 1 partial, 2 full
    kind[..., 0, :] = 0  # the first query block lists nothing (a test checks its rows give 0)
    part, fl = kind == 1, kind == 2
    if not full:
        part = part | fl
    t = _lists(B, H, M, N, part, fl if full else None)
    if compact:  # index rows shortened to the longest count (FA4's compact form)
        w = max(int(t.mask_block_cnt.max()), 1)
        t = t._replace(mask_block_idx=t.mask_block_idx[..., :w].contiguous())
    return BlockSparseTensorsTorch(*(x.to(device) if isinstance(x, torch.Tensor) else x for x in t))


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("block", [(128, 128), (256, 128), (128, 256)])
@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("Sq, Sk", [(512, 512), (300, 700)])
def test_visits_exactly_the_listed_blocks(defaults, d, block, full, Sq, Sk):
    torch.manual_seed(0)
    B, H, Hk = 2, 4, 2
    q = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Sk, Hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    M, N = -(-Sq // block[0]), -(-Sk // block[1])
    t = _random_lists(B, H, M, N, "cuda", full=full, compact=not full)._replace(block_size=block)
    bs.check_values(t, Sk)
    out, lse = interface.flash_attn_func(q, k, v, mask_mod=m.window_mask, block_sparse_tensors=t, return_lse=True)
    seen, partial = bs.visited(t, B, H, Sq, Sk, block)
    qi = torch.arange(Sq, device="cuda")[:, None]
    ki = torch.arange(Sk, device="cuda")[None, :]
    win = ((qi - ki).abs() <= m.WINDOW)
    scale = d ** -0.5
    ref = _reference(q, k, v, scale, seen, partial, mask_fn=win)
    ref_lp = _reference(q, k, v, scale, seen, partial, mask_fn=win, dtype=q.dtype)
    err = (out.float() - ref).abs().max().item()
    assert err <= 2 * (ref_lp - ref).abs().max().item() + ref.abs().max().item() * 2 ** -8
    empty = ~(seen & (~partial | win)).any(-1)  # (B, H, Sq): rows that see no key
    assert bool((out.float().transpose(1, 2)[empty] == 0).all())
    assert bool(empty[:, :, :block[0]].all())  # the first query tile of every (b, h) lists nothing


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("score, causal", [("rel_bias", False), (None, True), ("alibi_aux", True)])
def test_score_mods_and_native_causal_with_sparsity(defaults, score, causal):
    torch.manual_seed(1)
    B, H, S, d = 2, 4, 640, 128
    q = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    t = _random_lists(1, H, 5, 5, "cuda", seed=3)._replace(block_size=(128, 128))  # shared across the batch
    aux = [torch.rand(H, device="cuda")] if score == "alibi_aux" else None
    fn = getattr(m, score) if score else None
    out = interface.flash_attn_func(q, k, v, score_mod=fn, aux_tensors=aux, causal=causal, block_sparse_tensors=t)[0]
    seen, partial = bs.visited(t, B, H, S, S, (128, 128))
    tfn = getattr(m, score + "_torch") if score else None
    ref = _reference(q, k, v, d ** -0.5, seen, partial, score_fn=tfn, aux=aux, causal=causal)
    ref_lp = _reference(q, k, v, d ** -0.5, seen, partial, score_fn=tfn, aux=aux, causal=causal, dtype=q.dtype)
    err = (out.float() - ref).abs().max().item()
    assert err <= 2 * (ref_lp - ref).abs().max().item() + ref.abs().max().item() * 2 ** -8


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("S", [1024, 1000])
def test_against_flex_attention_with_the_same_block_mask(defaults, S):
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(2)
    B, H, d = 2, 4, 128
    docs = (torch.arange(S, device="cuda") // 300).to(torch.int32).expand(B, S).contiguous()

    def doc_causal(b, h, qi, ki):
        return (qi >= ki) & (docs[b, qi] == docs[b, ki])

    bm = fa.create_block_mask(doc_causal, B, 1, S, S, device="cuda", BLOCK_SIZE=128)
    q = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ref = fa.flex_attention(*(x.transpose(1, 2).float() for x in (q, k, v)), block_mask=bm).transpose(1, 2)
    ref_lp = torch.compile(fa.flex_attention)(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=bm).transpose(1, 2)
    out = interface.flash_attn_func(q, k, v, mask_mod=m.document_causal_mask, aux_tensors=[docs],
                                    block_sparse_tensors=bs.from_block_mask(bm))[0]
    err = (out.float() - ref).abs().max().item()
    assert err <= 2 * (ref_lp.float() - ref).abs().max().item() + ref.abs().max().item() * 2 ** -8


# --- compute_block_sparsity: the lists from a mask_mod ---------------------------------------------------------

def _kinds_reference(keep, tile_m, tile_n):
    """(B, H, M, N) tile kinds of a bool (B, H, Sq, Sk) mask: 0 nothing kept, 2 every in-bounds pair kept, else 1."""
    B, H, Sq, Sk = keep.shape
    M, N = -(-Sq // tile_m), -(-Sk // tile_n)
    pad = torch.zeros(B, H, M * tile_m, N * tile_n, dtype=torch.int32, device=keep.device)
    inb = torch.zeros_like(pad)
    pad[..., :Sq, :Sk] = keep.to(torch.int32)
    inb[..., :Sq, :Sk] = 1
    kept = pad.view(B, H, M, tile_m, N, tile_n).sum((3, 5))
    total = inb.view(B, H, M, tile_m, N, tile_n).sum((3, 5))
    return torch.where(kept == 0, 0, torch.where(kept == total, 2, 1))


def test_pack_kinds_orders_and_splits_the_lists():
    from flash_attn.cute.compute_block_sparsity import pack_kinds

    kind = torch.tensor([[[[2, 0, 1, 1, 2], [0, 0, 0, 0, 0]]]], dtype=torch.int32)
    t = pack_kinds(kind)
    assert t.mask_block_cnt.tolist() == [[[2, 0]]] and t.mask_block_idx[0, 0, 0, :2].tolist() == [2, 3]
    assert t.full_block_cnt.tolist() == [[[2, 0]]] and t.full_block_idx[0, 0, 0, :2].tolist() == [0, 4]
    one = pack_kinds(kind, compute_full_blocks=False)
    assert one.full_block_cnt is None and one.mask_block_idx[0, 0, 0, :4].tolist() == [0, 2, 3, 4]
    seen, partial = bs.visited(t, 1, 1, 2 * 128, 5 * 128, (128, 128))
    assert torch.equal(seen[0, 0, ::128, ::128].to(torch.int32), (kind[0, 0] > 0).to(torch.int32))


@pytest.mark.parametrize("kw, err, match", [
    (dict(seqused_q=torch.zeros(1, dtype=torch.int32)), NotImplementedError, "seqused_q"),
    (dict(cu_seqlens_q=torch.zeros(2, dtype=torch.int32)), ValueError, "cu_total_m_blocks must be given"),
    (dict(cu_total_m_blocks=torch.zeros(2, dtype=torch.int32)), ValueError, "belong to packed queries"),
    (dict(seqused_k=torch.zeros(1, dtype=torch.int32), cu_seqlens_k=torch.zeros(2, dtype=torch.int32)), ValueError,
     "not both"),
    (dict(device="cpu"), ValueError, "CUDA device"),
    (dict(mask_mod=3), ValueError, "CuTeDSL function"),
    (dict(tile_m=0), ValueError, "tile_m"),
])
def test_compute_block_sparsity_refuses(kw, err, match):
    from flash_attn.cute.compute_block_sparsity import compute_block_sparsity

    args = dict(tile_m=128, tile_n=128, batch_size=1, num_heads=1, seqlen_q=256, seqlen_k=256,
                mask_mod=m.causal_mask, aux_tensors=None, device="cuda")
    args.update(kw)
    with pytest.raises(err, match=match):
        compute_block_sparsity(**args)


def test_packed_varlen_lists_round_trip():
    """compute_block_sparsity's packed form (FA4's) of per-sequence lists, and normalize_varlen's layout of it, give
    back the lists of every sequence's query blocks (with and without cu_block_idx_offsets)."""
    from flash_attn.cute.compute_block_sparsity import _packed, pack_kinds

    g = torch.Generator().manual_seed(11)
    seq_q, seq_k = [300, 1, 128], [200, 700, 128]
    B, H, M, N = 3, 2, 3, 6
    kind = torch.randint(0, 3, (B, H, M, N), generator=g, dtype=torch.int32)
    for b in range(B):  # nothing past a sequence's end, as the classifier gives
        kind[b, :, -(-seq_q[b] // 128):] = 0
        kind[b, :, :, -(-seq_k[b] // 128):] = 0
    lists = pack_kinds(kind)._replace(block_size=(128, 128))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    num_m = [-(-s // 128) for s in seq_q]
    cu_m = i32([0] + list(torch.tensor(num_m).cumsum(0)))
    per = [mb * -(-s // 128) for mb, s in zip(num_m, seq_k)]
    cu_n = i32([0] + list(torch.tensor(per).cumsum(0)))
    packed = _packed(lists, cu_m, cu_n, N)
    assert packed.mask_block_cnt.shape == (H, 5) and packed.mask_block_idx.shape == (H, int(cu_n[-1]))
    call = bs.normalize_varlen(packed, B, H, max(seq_q), max(seq_k), 128, 128, CPU)
    want = bs.visited(lists, B, H, max(seq_q), max(seq_k), (128, 128))
    got = bs.visited(BlockSparseTensorsTorch(*call.tensors), B, H, max(seq_q), max(seq_k), (128, 128))
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    uniform = pack_kinds(kind[..., :2].contiguous())._replace(block_size=(128, 128))
    packed = _packed(uniform, cu_m, None, 2)
    assert packed.mask_block_idx.shape == (H, 5 * 2) and packed.cu_block_idx_offsets is None
    call = bs.normalize_varlen(packed, B, H, max(seq_q), 256, 128, 128, CPU)
    want = bs.visited(uniform, B, H, max(seq_q), 256, (128, 128))
    got = bs.visited(BlockSparseTensorsTorch(*call.tensors), B, H, max(seq_q), 256, (128, 128))
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("keys", ["cu_seqlens_k", "seqused_k", "uniform"])
def test_varlen_compute_block_sparsity_matches_each_sequence(cute_env, keys):
    """FA4's varlen compute_block_sparsity: each sequence's lists (its own lengths, bottom-right causal) are those of
    the sequence computed alone."""
    from flash_attn.cute.compute_block_sparsity import compute_block_sparsity

    cute_env()
    seq_q = [300, 1, 128, 517]
    seq_k = [200, 700, 128, 517] if keys != "uniform" else [640] * 4
    B, H = len(seq_q), 2
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device="cuda")  # noqa: E731
    cu = lambda lens: i32([0] + list(torch.tensor(lens).cumsum(0)))  # noqa: E731
    num_m = [-(-s // 128) for s in seq_q]
    kw = dict(cu_seqlens_q=cu(seq_q), cu_total_m_blocks=cu(num_m))
    if keys == "cu_seqlens_k":
        kw["cu_seqlens_k"] = cu(seq_k)
    elif keys == "seqused_k":
        kw["seqused_k"] = i32(seq_k)
    got = compute_block_sparsity(128, 128, B, H, max(seq_q), max(seq_k), m.causal_mask, None, "cuda", **kw)
    assert (got.cu_block_idx_offsets is None) == (keys == "uniform")
    call = bs.normalize_varlen(got, B, H, max(seq_q), max(seq_k), 128, 128, torch.device("cuda", 0))
    seen, partial = bs.visited(BlockSparseTensorsTorch(*call.tensors), B, H, max(seq_q), max(seq_k), (128, 128))
    for b in range(B):
        alone = compute_block_sparsity(128, 128, 1, H, seq_q[b], seq_k[b], m.causal_mask, None, "cuda")
        s1, p1 = bs.visited(alone, 1, H, seq_q[b], seq_k[b], (128, 128))
        assert torch.equal(seen[b, :, :seq_q[b], :seq_k[b]], s1[0]), b
        assert torch.equal(partial[b, :, :seq_q[b], :seq_k[b]], p1[0]), b


def test_varlen_block_kinds_kernel_compiles_for_sm90a(tmp_path):
    from flash_attn.cute.compute_block_sparsity import BlockKinds

    BlockKinds(m.causal_mask, 128, 128, False, False, varlen=(True, False, True)).compile(
        (), dump_dir=str(tmp_path))
    ptx, = glob.glob(os.path.join(tmp_path, "**", "*.ptx"), recursive=True)
    assert "ld.global" in open(ptx).read()


@pytest.mark.parametrize("mask, fast", [("document", False), ("causal", True)])
def test_block_kinds_kernel_compiles_for_sm90a(tmp_path, mask, fast):
    from flash_attn.cute.compute_block_sparsity import BlockKinds

    fn = m.document_mask if mask == "document" else m.causal_mask
    spec = ((torch.int32, 2),) if mask == "document" else ()
    BlockKinds(fn, 128, 128, bool(spec), fast).compile(spec, dump_dir=str(tmp_path))
    ptx, = glob.glob(os.path.join(tmp_path, "**", "*.ptx"), recursive=True)
    text = open(ptx).read()
    assert ".target sm_90a" in text and "st.global" in text


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["causal", "window", "document"])
@pytest.mark.parametrize("Sq, Sk, tile", [(512, 512, (128, 128)), (300, 700, (128, 128)), (1000, 1000, (256, 128))])
def test_compute_block_sparsity_matches_the_mask(defaults, mask, Sq, Sk, tile):
    from flash_attn.cute.compute_block_sparsity import compute_block_sparsity

    B, H = 2, 3
    fn, fn_torch = m.MASK_MODS[mask]
    aux = None
    if mask == "document":
        S = max(Sq, Sk)
        aux = [(torch.arange(S, device="cuda") // 150 + torch.arange(B, device="cuda")[:, None]).to(torch.int32)]
    t = compute_block_sparsity(tile[0], tile[1], B, H, Sq, Sk, fn, aux, "cuda")
    keep = fn_torch(Sq, Sk, "cuda", aux) if mask == "document" else fn_torch(Sq, Sk, "cuda")
    keep = keep.expand(B, H, Sq, Sk)
    ref = _kinds_reference(keep, *tile)
    got = torch.zeros_like(ref)
    seen, partial = bs.visited(t, B, H, Sq, Sk, tile)
    got = torch.where(seen[..., ::tile[0], ::tile[1]], torch.where(partial[..., ::tile[0], ::tile[1]], 1, 2), 0)
    assert torch.equal(got, ref)
    assert t.block_size == tile
    bs.check_values(t, Sk)
    # the attention over the computed lists: the dense mask's result
    d = 128
    q = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Sk, H, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out = interface.flash_attn_func(q, k, v, mask_mod=fn, aux_tensors=aux, block_sparse_tensors=t)[0]
    full = torch.ones_like(seen)
    ref_out = _reference(q, k, v, d ** -0.5, full, full, mask_fn=keep)
    ref_lp = _reference(q, k, v, d ** -0.5, full, full, mask_fn=keep, dtype=q.dtype)
    err = (out.float() - ref_out).abs().max().item()
    assert err <= 2 * (ref_lp - ref_out).abs().max().item() + ref_out.abs().max().item() * 2 ** -8


@needs_gpu
@pytest.mark.gpu
def test_fast_sampling_decides_a_causal_mask(defaults):
    from flash_attn.cute.compute_block_sparsity import compute_block_sparsity

    exact = compute_block_sparsity(128, 128, 1, 1, 1024, 1024, m.causal_mask, None, "cuda")
    fast = compute_block_sparsity(128, 128, 1, 1, 1024, 1024, m.causal_mask, None, "cuda", use_fast_sampling=True)
    for a, b in zip(exact[:4], fast[:4]):
        assert torch.equal(a, b)


def test_mask_mod_calls_get_lists_built_once_per_shape(cute_env, monkeypatch):
    """A mask_mod call without block_sparse_tensors (and without aux tensors) runs on lists built from its mask_mod,
    once per (function, shape); with aux tensors, or FLASH_ATTN_CUTE_DISABLE=mask_sparsity, it visits every tile."""
    from flash_attn.cute import compute_block_sparsity as cbs
    from flash_attn.cute.plan import _UNBOUNDED

    cute_env()
    built, launched = [], []

    def fake_compute(tile_m, tile_n, B, H, Sq, Sk, mask_mod, aux, device, aux_scalars=None):
        built.append((tile_m, tile_n, B, H, Sq, Sk, mask_mod))
        kind = torch.ones(B, H, -(-Sq // tile_m), -(-Sk // tile_n), dtype=torch.int32)
        return cbs.pack_kinds(kind)._replace(block_size=(tile_m, tile_n))

    monkeypatch.setattr(cbs, "compute_block_sparsity", fake_compute)
    monkeypatch.setattr(mods, "_mask_lists", {})
    monkeypatch.setattr(mods, "mod_kernel", lambda *a, scalars=(), block_m=None, sink=False: (
        lambda *args: launched.append((a, args))))
    q = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 500, 4, 64, dtype=torch.bfloat16)
    run = lambda mask, aux=None: mods.forward(q, k, k, 0.1, False, "sm_90a", _UNBOUNDED, _UNBOUNDED, None,  # noqa
                                               mask, aux)
    run(m.causal_mask)
    assert built == [(128, 128, 2, 4, 300, 500, m.causal_mask)]
    (key, args), = launched
    assert key[-2] == (True, 1, 1) and len(args[-2]) == 4  # the sparse kernel and its four lists
    run(m.causal_mask)
    assert len(built) == 1 and launched[-1][0][-2] == (True, 1, 1)  # remembered
    run(m.window_mask)
    assert len(built) == 2
    run(m.document_mask, [torch.zeros(2, 500, dtype=torch.int32)])  # aux: the lists would depend on its values
    assert len(built) == 2 and len(launched[-1][0]) == 9 and launched[-1][1][-2] is None
    cute_env(DISABLE="mask_sparsity")
    run(m.causal_mask)
    assert len(built) == 2 and launched[-1][1][-2] is None


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["causal", "window", "shift"])
def test_mask_mod_alone_skips_tiles_and_matches(cute_env, mask):
    cute_env()
    torch.manual_seed(4)
    B, H, S, d = 2, 4, 1000, 128
    q = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    fn, fn_torch = m.MASK_MODS[mask]
    mods._mask_lists.clear()
    out = interface.flash_attn_func(q, k, v, mask_mod=fn)[0]
    assert any(key[0] == mods.fn_key(fn) for key in mods._mask_lists)  # (keyed by code and closure: mods.fn_key)
    cute_env(DISABLE="mask_sparsity")
    every = interface.flash_attn_func(q, k, v, mask_mod=fn)[0]
    keep = fn_torch(S, S, "cuda")
    full = torch.ones(B, H, S, S, dtype=torch.bool, device="cuda")
    ref = _reference(q, k, v, d ** -0.5, full, full, mask_fn=keep)
    ref_lp = _reference(q, k, v, d ** -0.5, full, full, mask_fn=keep, dtype=q.dtype)
    bound = 2 * (ref_lp - ref).abs().max().item() + ref.abs().max().item() * 2 ** -8
    assert (out.float() - ref).abs().max().item() <= bound
    assert (every.float() - ref).abs().max().item() <= bound


# --- the mask_mod's backward ------------------------------------------------------------------------------------

def test_mask_mod_gradients_go_to_the_mask_mod_backward_kernel(cute_env, monkeypatch):
    from flash_attn.cute import launch

    cute_env()
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    monkeypatch.setattr(mods, "forward", lambda q, k, v, *a: (torch.zeros_like(q),
                                                               torch.zeros(q.shape[0], q.shape[2], q.shape[1])))
    built, seen = [], []
    monkeypatch.setattr(mods, "mod_bwd_kernel", lambda *a, block_m=None, local=False: built.append(a) or "kernel")

    def fake_backward(dout, q, k, v, out, lse, scale, causal, arch, dlse=None, mod=None, window=None):
        from flash_attn.cute import kernels
        assert mod[4] == kernels.bwd_config(torch.bfloat16, 64, False, "sm_90a").block_m  # the kernel's query block
        seen.append((scale, causal, mod, dlse))
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)

    monkeypatch.setattr(launch, "backward", fake_backward)
    q, k, v = (t.requires_grad_() for t in _qkv())
    docs = [torch.zeros(2, 7, dtype=torch.int32)]
    out, lse = interface.flash_attn_func(q, k, v, mask_mod=m.document_mask, aux_tensors=docs, return_lse=True)
    (out.sum() + lse.sum()).backward()
    assert built == [(torch.bfloat16, 64, "sm_90a", m.document_mask, ((torch.int32, 2),), None, (), None, None,
                      False)]
    (scale, causal, mod, dlse), = seen
    assert mod[0] == "kernel" and mod[1][0] is docs[0] and mod[2] is None and not causal and dlse is not None
    assert torch.equal(q.grad, torch.ones_like(q)) and torch.equal(v.grad, torch.ones_like(v))
    # a mask_mod without aux tensors: the backward walks lists built from it (per key block), as the forward
    lists = []
    monkeypatch.setattr(mods, "mask_lists_bwd", lambda *a: lists.append(a) or ("lists",))
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    interface.flash_attn_func(q2, k2, v2, mask_mod=m.causal_mask)[0].sum().backward()
    assert built[-1][5] == (True, 1, 1) and seen[-1][2][:4] == ("kernel", None, ("lists",), None)
    assert lists[0][:5] == (m.causal_mask, 2, 4, 7, 7) and lists[0][6] == 128
    cute_env(DISABLE="mask_sparsity")
    q3 = q.detach().requires_grad_()
    interface.flash_attn_func(q3, k, v, mask_mod=m.causal_mask)[0].sum().backward()
    assert built[-1][5] is None and len(lists) == 1


@pytest.mark.parametrize("kw, err, match", [
    (dict(score_mod=m.rel_bias), ValueError, "needs score_mod_bwd"),
    (dict(mask_mod=m.causal_mask, d=40), NotImplementedError, "head dims"),
    (dict(score_mod=m.rel_bias, score_mod_bwd=m.additive_bwd, varlen=True, deterministic=True), NotImplementedError,
     "deterministic"),
    (dict(score_mod=m.rel_bias, varlen=True), ValueError, "needs score_mod_bwd"),
])
def test_backwards_not_served_are_refused(cute_env, monkeypatch, kw, err, match):
    cute_env()
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    q, k, v = _qkv(d=kw.pop("d", 64))
    q.requires_grad_()
    if kw.pop("varlen", False):
        cu = torch.tensor([0, 7, 14], dtype=torch.int32)
        with pytest.raises(err, match=match):
            interface.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens_q=cu,
                                             cu_seqlens_k=cu, **kw)
        return
    with pytest.raises(err, match=match):
        interface.flash_attn_func(q, k, v, **kw)


def test_mask_mod_backward_kernel_compiles_without_spills(tmp_path):
    kernels = pytest.importorskip("flash_attn.cute.kernels")
    kernels.compile_bwd(torch.bfloat16, 64, False, "sm_90a", dump_dir=str(tmp_path), mask_mod=m.document_mask,
                        spec=((torch.int32, 2),))
    ptx, = glob.glob(os.path.join(tmp_path, "**", "*.ptx"), recursive=True)
    text = open(ptx).read()
    assert "wgmma.mma_async" in text and "ld.global" in text  # the document ids are read in the loop
    if shutil.which("ptxas"):
        assert_ptxas_clean(ptx)


def _grads_reference(q, k, v, dout, keep, dtype):
    qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    g = qr.shape[2] // kr.shape[2]
    s = qr.transpose(1, 2) @ kr.repeat_interleave(g, 2).transpose(1, 2).transpose(-1, -2) * q.shape[-1] ** -0.5
    p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0)
    o = (p @ vr.repeat_interleave(g, 2).transpose(1, 2)).transpose(1, 2)
    o.backward(dout.to(dtype))
    return o.float(), [t.grad.float() for t in (qr, kr, vr)]


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("mask", ["causal", "window", "document"])
@pytest.mark.parametrize("Sq, Sk", [(256, 256), (300, 517)])
@pytest.mark.parametrize("lists", [True, False])
def test_mask_mod_gradients_match_the_reference(cute_env, d, mask, Sq, Sk, lists):
    """Without aux tensors (causal, window) the forward and backward walk lists built from the mask_mod; with
    FLASH_ATTN_CUTE_DISABLE=mask_sparsity, or the document mask's aux tensor, every tile."""
    cute_env(DISABLE=None if lists else "mask_sparsity")
    torch.manual_seed(5)
    B, H, Hk = 2, 4, 2
    q = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Sk, Hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Sk, Hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.bfloat16)
    fn, fn_torch = m.MASK_MODS[mask]
    aux = None
    if mask == "document":
        S = max(Sq, Sk)
        aux = [(torch.arange(S, device="cuda") // 97 + torch.arange(B, device="cuda")[:, None]).to(torch.int32)]
        keep = fn_torch(Sq, Sk, "cuda", aux)
    else:
        keep = fn_torch(Sq, Sk, "cuda")
    out = interface.flash_attn_func(q, k, v, mask_mod=fn, aux_tensors=aux)[0]
    out.backward(dout)
    ref, ref_grads = _grads_reference(q, k, v, dout, keep, torch.float32)
    ref_lp, lp_grads = _grads_reference(q, k, v, dout, keep, torch.bfloat16)
    m.assert_close_to_oracle((out, q.grad, k.grad, v.grad), (ref, *ref_grads), (ref_lp, *lp_grads))


def test_backward_lists_from_a_block_mask(cute_env, monkeypatch):
    """FlexAttention's BlockMask gives the backward's lists too (per key block its query blocks): normalize_bwd takes
    them at the backward kernel's tiles (128-row sparse query blocks walk as two 64-row kernel blocks), and a call
    with both lists and gradients hands them to the backward kernel."""
    from flash_attn.cute import launch

    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    bm = fa.create_block_mask(lambda b, h, q, k: q >= k, 1, 1, 300, 300, device="cpu", BLOCK_SIZE=128)
    tb = bs.from_block_mask_bwd(bm)
    call = bs.normalize_bwd(tb, 2, 4, 300, 300, 64, 128, CPU)
    assert (call.q_factor, call.kv_factor, call.block_n) == (1, 2, 64) and call.spec == (True, 1, 2)
    assert call.tensors[0].shape == (1, 1, 3)  # per key block
    # the same pairs as the forward's lists, transposed
    fwd_seen, fwd_partial = bs.visited(bs.from_block_mask(bm), 1, 1, 300, 300, (128, 128))
    bwd_seen, bwd_partial = bs.visited(tb, 1, 1, 300, 300, (128, 128))
    assert torch.equal(fwd_seen, bwd_seen.transpose(2, 3)) and torch.equal(fwd_partial, bwd_partial.transpose(2, 3))
    cute_env()
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    monkeypatch.setattr(mods, "forward", lambda q, k, v, *a: (torch.zeros_like(q),
                                                               torch.zeros(q.shape[0], q.shape[2], q.shape[1])))
    built, seen = [], []
    monkeypatch.setattr(mods, "mod_bwd_kernel", lambda *a, block_m=None, local=False: built.append(a) or "kernel")
    monkeypatch.setattr(launch, "backward", lambda *a, dlse=None, mod=None, window=None: seen.append(mod) or
                        tuple(torch.zeros_like(t) for t in a[1:4]))
    q = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    out = interface.flash_attn_func(q, k, v, mask_mod=m.causal_mask, block_sparse_tensors=bs.from_block_mask(bm),
                                    block_sparse_tensors_bwd=tb)[0]
    out.sum().backward()
    assert built[-1][3] is m.causal_mask and built[-1][5][0] is True and len(seen[-1][2]) == 4


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", [None, "window"])
@pytest.mark.parametrize("block", [(128, 128), (256, 128), (128, 256), (64, 128), (192, 128)])
@pytest.mark.parametrize("low_level", [False, True])
def test_block_sparse_gradients_match_the_reference(cute_env, d, mask, block, low_level):
    """Random lists (the forward's per query block, the backward's their transpose, as a BlockMask gives them) with
    and without a mask_mod: the outputs and gradients of attention over the listed pairs, through autograd and
    through FA4's low-level _flash_attn_fwd / _flash_attn_bwd (whose block_sparse_tensors are the backward's)."""
    from flash_attn.cute.compute_block_sparsity import pack_kinds

    cute_env()
    torch.manual_seed(6)
    B, H, Hk, Sq, Sk = 2, 4, 2, 600, 520
    M, N = -(-Sq // block[0]), -(-Sk // block[1])
    g = torch.Generator().manual_seed(7)
    kind = torch.randint(0, 3, (B, H, M, N), generator=g, dtype=torch.int32).cuda()
    fwd = pack_kinds(kind)._replace(block_size=block)
    bwd = pack_kinds(kind.transpose(2, 3).contiguous())._replace(block_size=block)
    q = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Sk, Hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Sk, Hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.bfloat16)
    fn = m.window_mask if mask else None
    if low_level:
        with torch.no_grad():
            out, lse, *_ = interface._flash_attn_fwd(q, k, v, mask_mod=fn, block_sparse_tensors=fwd, return_lse=True)
            for t, g in zip((q, k, v), interface._flash_attn_bwd(q, k, v, out, dout, lse, mask_mod=fn,
                                                                 block_sparse_tensors=bwd)):
                t.grad = g
    else:
        out = interface.flash_attn_func(q, k, v, mask_mod=fn, block_sparse_tensors=fwd,
                                        block_sparse_tensors_bwd=bwd)[0]
        out.backward(dout)
    seen, partial = bs.visited(fwd, B, H, Sq, Sk, block)
    keep = seen
    if mask:
        keep = seen & (~partial | m.window_mask_torch(Sq, Sk, "cuda"))
    ref, ref_grads = _grads_reference(q, k, v, dout, keep, torch.float32)
    ref_lp, lp_grads = _grads_reference(q, k, v, dout, keep, torch.bfloat16)
    m.assert_close_to_oracle((out, q.grad, k.grad, v.grad), (ref, *ref_grads), (ref_lp, *lp_grads))


def test_low_level_backward_takes_the_mods(cute_env, monkeypatch):
    """FA4's _flash_attn_bwd with mods: its block_sparse_tensors are the backward's lists; dense calls go to
    mods.backward, varlen ones to mods.backward_varlen, with the call's mods and options."""
    cute_env()
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    from flash_attn.cute import lowlevel

    monkeypatch.setattr(lowlevel.launch, "_device_arch", lambda q, k, v: "sm_90a")
    seen = []
    monkeypatch.setattr(mods, "backward", lambda *a: seen.append(("dense", a)) or tuple(torch.ones_like(t)
                                                                                         for t in a[1:4]))
    monkeypatch.setattr(mods, "backward_varlen", lambda *a: seen.append(("varlen", a)) or
                        tuple(torch.ones_like(t) for t in a[1:4]))
    q, k, v = _qkv()
    out, dout, lse = torch.zeros_like(q), torch.randn_like(q), torch.zeros(2, 4, 7)
    tb = _lists(1, 1, 1, 1, torch.ones(1, 1, 1, 1, dtype=torch.bool))
    dq = torch.empty_like(q)
    grads = interface._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=0.5, mask_mod=m.causal_mask,
                                      block_sparse_tensors=tb, aux_scalars=None, dq=dq)
    kind, a = seen[-1]
    assert kind == "dense" and a[7] == 0.5 and a[11] is m.causal_mask and a[13] is tb and grads[0] is dq
    cu = torch.tensor([0, 7, 14], dtype=torch.int32)
    flat = [t.flatten(0, 1) for t in (q, k, v, out, dout)]
    interface._flash_attn_bwd(*flat[:5], torch.zeros(4, 14), score_mod=m.rel_bias, score_mod_bwd=m.additive_bwd,
                              cu_seqlens_q=cu, cu_seqlens_k=cu)
    kind, a = seen[-1]
    assert kind == "varlen" and a[9] is m.rel_bias and a[10] is m.additive_bwd and a[14] is cu and a[17] == 7
    with pytest.raises(NotImplementedError, match="no block sparsity"):
        interface._flash_attn_bwd(*flat[:5], torch.zeros(4, 14), mask_mod=m.causal_mask, block_sparse_tensors=tb,
                                  cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_fa4_mod_helpers_compile_to_ptx_shifts(tmp_path):
    """flash_attn.cute.utils (FA4's helpers for mod authors): scalar_to_ssa, and shifts that are PTX's shr / shl."""
    mods.compile_fwd_mods(torch.bfloat16, 128, False, arch="sm_90a", dump_dir=str(tmp_path), mask_mod=m.shift_mask)
    ptx, = glob.glob(os.path.join(tmp_path, "**", "*.ptx"), recursive=True)
    text = open(ptx).read()
    assert "shr.b32" in text and "shl.b32" in text


def test_fast_sampling_marks_and_mod_kernel_caches_are_fa4s():
    from flash_attn.cute import cache_utils

    def f():
        pass
    assert bs.fast_sampling(f) is f and f.use_fast_sampling is True
    assert interface._flash_attn_fwd.compile_cache is mods._mod_kernels is cache_utils.get_jit_cache("mods_fwd")
    assert interface._flash_attn_bwd.compile_cache is mods._mod_bwd_kernels
    c = cache_utils.JITCache()
    c["k"] = f
    assert "k" in c and c["k"] is f and len(c.cache) == 1
    c.clear()
    assert "k" not in c and cache_utils.get_jit_cache() is not cache_utils.get_jit_cache()


# --- aux_scalars ------------------------------------------------------------------------------------------------

def test_scalar_spec_reads_python_and_cutlass_numbers():
    import cutlass

    assert mods.scalar_spec(None) == ((), ())
    assert mods.scalar_spec([3, 0.5, cutlass.Int32(7), cutlass.Float32(2.5)]) == (("i", "f", "i", "f"),
                                                                                 (3, 0.5, 7, 2.5))
    with pytest.raises(ValueError, match=r"aux_scalars\[0\]"):
        mods.scalar_spec([True])
    with pytest.raises(ValueError, match="list"):
        mods.scalar_spec(3)


def test_kernels_with_aux_scalars_compile(tmp_path):
    mods.compile_fwd_mods(torch.bfloat16, 128, False, arch="sm_90a", dump_dir=str(tmp_path), score_mod=m.scaled,
                          mask_mod=m.scalar_limit_mask, sparse=(True, 1, 1), scalars=("f",))
    ptx, = glob.glob(os.path.join(tmp_path, "**", "*.ptx"), recursive=True)
    assert "wgmma.mma_async" in open(ptx).read()


def test_aux_scalars_reach_the_launch_and_key_the_lists(cute_env, monkeypatch):
    from flash_attn.cute import compute_block_sparsity as cbs
    from flash_attn.cute.plan import _UNBOUNDED

    cute_env()
    built, launched = [], []

    def fake_compute(tile_m, tile_n, B, H, Sq, Sk, mask_mod, aux, device, aux_scalars=None):
        built.append(aux_scalars)
        kind = torch.ones(B, H, -(-Sq // tile_m), -(-Sk // tile_n), dtype=torch.int32)
        return cbs.pack_kinds(kind)._replace(block_size=(tile_m, tile_n))

    monkeypatch.setattr(cbs, "compute_block_sparsity", fake_compute)
    monkeypatch.setattr(mods, "_mask_lists", {})
    monkeypatch.setattr(mods, "mod_kernel", lambda *a, scalars=(), block_m=None, sink=False: (
        lambda *args: launched.append((scalars, args))))
    q = torch.randn(1, 256, 2, 64, dtype=torch.bfloat16)
    for limit in (64, 64, 100):
        mods.forward(q, q, q, 0.1, False, "sm_90a", _UNBOUNDED, _UNBOUNDED, m.scaled, m.scalar_limit_mask, None,
                     None, [0.5, limit])
    assert built == [[0.5, 64], [0.5, 100]]  # the lists depend on the values: one per value
    assert launched[-1][0] == ("f", "i") and launched[-1][1][-1] == (0.5, 100)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("limit", [64, 300])
def test_aux_scalars_match_the_reference(cute_env, limit):
    import cutlass

    cute_env()
    torch.manual_seed(8)
    B, H, S, d = 2, 4, 512, 128
    q = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, S, H, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    qi = torch.arange(S, device="cuda")[:, None]
    ki = torch.arange(S, device="cuda")[None, :]
    keep = (ki <= qi) & (ki < limit)
    full = torch.ones(B, H, S, S, dtype=torch.bool, device="cuda")
    # a score_mod and a mask_mod reading the scalars (forward)
    with torch.no_grad():
        out = interface.flash_attn_func(q, k, v, score_mod=m.scaled, mask_mod=m.scalar_limit_mask,
                                        aux_scalars=[0.5, cutlass.Int32(limit)])[0]
    scale = d ** -0.5
    ref = _reference(q, k, v, scale, full, full, score_fn=lambda s, a: s * 0.5, mask_fn=keep)
    ref_lp = _reference(q, k, v, scale, full, full, score_fn=lambda s, a: s * 0.5, mask_fn=keep, dtype=q.dtype)
    assert (out.float() - ref).abs().max().item() <= (2 * (ref_lp - ref).abs().max().item()
                                                       + ref.abs().max().item() * 2 ** -8)
    # the mask_mod alone, with gradients
    dout = torch.randn_like(q)
    out = interface.flash_attn_func(q, k, v, mask_mod=m.scalar_limit_mask, aux_scalars=[limit])[0]
    out.backward(dout)
    ref, ref_grads = _grads_reference(q, k, v, dout, keep, torch.float32)
    ref_lp, lp_grads = _grads_reference(q, k, v, dout, keep, torch.bfloat16)
    m.assert_close_to_oracle((out, q.grad, k.grad, v.grad), (ref, *ref_grads), (ref_lp, *lp_grads))


def test_a_deterministic_mods_backward_is_refused(cute_env, monkeypatch):
    cute_env()
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    q, k, v = _qkv()
    q.requires_grad_()
    with pytest.raises(NotImplementedError, match="deterministic"):
        interface.flash_attn_func(q, k, v, mask_mod=m.causal_mask, deterministic=True)


def test_native_causal_reaches_the_mods_backward(cute_env, monkeypatch):
    from flash_attn.cute import launch

    cute_env()
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    fwd = []
    monkeypatch.setattr(mods, "forward", lambda q, k, v, scale, causal, arch, wl, wr, *a: fwd.append((causal, wr))
                        or (torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])))
    built, seen = [], []
    monkeypatch.setattr(mods, "mod_bwd_kernel", lambda *a, block_m=None, local=False: built.append(a) or "kernel")
    monkeypatch.setattr(launch, "backward", lambda dout, q, k, v, out, lse, scale, causal, arch, dlse=None, mod=None,
                        window=None:
                        seen.append(causal) or (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)))
    q, k, v = (t.requires_grad_() for t in _qkv())
    interface.flash_attn_func(q, k, v, score_mod=m.rel_bias, score_mod_bwd=m.additive_bwd, causal=True)[0].sum() \
        .backward()
    from flash_attn.cute.plan import _UNBOUNDED

    assert fwd == [(True, _UNBOUNDED)] and built[-1][-1] is True and seen == [True]  # causal, no window
    assert built[-1][7] is m.rel_bias and built[-1][8] is m.additive_bwd


def test_score_mod_window_reaches_the_mods_backward(cute_env, monkeypatch):
    """A score_mod with a sliding window and gradients: the forward and the backward kernel (built with local=True) get
    the window, dense and varlen; negative sizes and block sparsity with a window are refused for gradients."""
    from flash_attn.cute import launch

    cute_env()
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    fwd, built, seen = [], [], []
    monkeypatch.setattr(mods, "forward", lambda q, k, v, scale, causal, arch, wl, wr, *a: fwd.append((causal, wl, wr))
                        or (torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])))
    monkeypatch.setattr(mods, "forward_varlen", lambda q, k, v, cu_q, cu_k, used_k, max_q, scale, causal, arch, wl,
                        wr, *a, sink=None: fwd.append((causal, wl, wr)) or (torch.zeros_like(q),
                                                                          torch.zeros(q.shape[1], q.shape[0])))
    monkeypatch.setattr(mods, "mod_bwd_kernel", lambda *a, block_m=None, local=False: built.append(local) or "kernel")
    monkeypatch.setattr(launch, "backward", lambda dout, q, k, v, out, lse, scale, causal, arch, dlse=None, mod=None,
                        window=None: seen.append((causal, window)) or (torch.zeros_like(q), torch.zeros_like(k),
                                                                       torch.zeros_like(v)))
    monkeypatch.setattr(launch, "backward_varlen", lambda dout, q, k, v, out, lse, *a, dlse=None, mod=None,
                        window=None: seen.append(window) or (torch.zeros_like(q), torch.zeros_like(k),
                                                             torch.zeros_like(v)))
    q, k, v = (t.requires_grad_() for t in _qkv())
    kw = dict(score_mod=m.rel_bias, score_mod_bwd=m.additive_bwd)
    interface.flash_attn_func(q, k, v, causal=True, window_size=(16, 0), **kw)[0].sum().backward()
    assert fwd[-1][1] == 16 and built == [True] and seen == [(False, (16, 0))]  # the window's kernel, causal in it
    interface.flash_attn_func(q, k, v, **kw)[0].sum().backward()
    assert built[-1] is False and seen[-1] == (False, None)  # no window: the plain mods kernel
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    qv, kv, vv = (t.detach()[0].requires_grad_() for t in (q, k, v))
    interface.flash_attn_varlen_func(qv, kv, vv, cu_seqlens_q=cu, cu_seqlens_k=cu, window_size=(5, 6),
                                     **kw)[0].sum().backward()
    assert fwd[-1] == (False, 5, 6) and built[-1] is True and seen[-1] == (5, 6)
    with pytest.raises(NotImplementedError, match="negative window"):
        interface.flash_attn_func(q, k, v, window_size=(-2, 8), **kw)
    t = _lists(1, 1, 1, 1, torch.ones(1, 1, 1, 1, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="window_size"):
        interface.flash_attn_func(q, k, v, window_size=(8, 8), block_sparse_tensors=t, block_sparse_tensors_bwd=t,
                                  **kw)


def test_varlen_mods_gradients_go_to_the_varlen_backward(cute_env, monkeypatch):
    from flash_attn.cute import launch

    cute_env()
    monkeypatch.setattr(interface, "_device_arch", lambda q, k, v: "sm_90a")
    fwd = []
    monkeypatch.setattr(mods, "forward_varlen", lambda q, k, v, cu_q, cu_k, used_k, max_q, scale, causal, arch, wl,
                        wr, *rest, sink=None: fwd.append((max_q, causal, rest)) or (torch.zeros_like(q),
                                                                         torch.zeros(q.shape[1], q.shape[0])))
    built, seen = [], []
    monkeypatch.setattr(mods, "mod_bwd_kernel", lambda *a, block_m=None, local=False: built.append(a) or "kernel")

    def fake_backward(dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, max_q, max_k, scale, causal, arch,
                      dlse=None, mod=None, window=None):
        seen.append((max_q, max_k, causal, mod))
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)

    monkeypatch.setattr(launch, "backward_varlen", fake_backward)
    q = torch.randn(14, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(14, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(14, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    out = interface.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, score_mod=m.scaled,
                                           score_mod_bwd=m.scaled_bwd, aux_scalars=[0.5], causal=True)[0]
    out.sum().backward()
    assert fwd == [(9, True, (m.scaled, None, None, [0.5]))]
    (max_q, max_k, causal, mod), = seen
    assert (max_q, max_k, causal) == (9, 9, True) and mod[0] == "kernel" and mod[2] == (0.5,) and mod[3] == 64
    assert built[-1][6:] == (("f",), m.scaled, m.scaled_bwd, True, True)
    assert torch.equal(q.grad, torch.ones_like(q))
