"""flash_attn._checks, function by function: every message names the argument and what was expected; the one-pass
acceptance of the common call agrees with an independent statement of the rules on shapes chosen so that
dimensions coincide (a check that reads the wrong dimension shows); the per-tensor cache of value checks
reruns exactly when the tensor, its version or the check's key changes."""
import gc
import random
import re

import pytest
import torch

from flash_attn import _checks

F16 = torch.float16


# ----------------------------------------------------------------------------------------------------
# qkv: the rules stated independently of _checks


def _rule(q, k, v, varlen):
    """None if (q, k, v) is acceptable, else the exception type the API raises first."""
    nd = 3 if varlen else 4
    for t in (q, k, v):
        if not isinstance(t, torch.Tensor):
            return TypeError
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return TypeError
    if q.dim() != nd:
        return ValueError
    for t in (k, v):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return TypeError
        if t.device != q.device:
            return ValueError
    if k.dim() != nd and not (varlen and k.dim() == 4):
        return ValueError
    if v.dim() != k.dim():
        return ValueError
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return TypeError
    for t in (q, k, v):
        if t.stride(-1) != 1 and t.shape[-1] != 1:
            return ValueError
    if k.shape[-1] != q.shape[-1] or v.shape[:-1] != k.shape[:-1]:
        return ValueError
    if not varlen and k.shape[0] != q.shape[0]:
        return ValueError
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        return ValueError
    if not (1 <= q.shape[-1] <= 256 and 1 <= v.shape[-1] <= 256):
        return ValueError
    return None


def _tensor(shape, dtype, contiguous_last, device="cpu"):
    if contiguous_last or not shape or shape[-1] <= 1:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.zeros((*shape[:-1], 2 * shape[-1]), dtype=dtype, device=device)[..., ::2]


def _random_case(rng, varlen):
    # small sizes so that a batch equals a head count or a sequence length equals a head dim by chance
    sizes = [1, 2, 3, 4]
    nd = 3 if varlen else 4

    def shape(rank):
        return tuple(rng.choice(sizes) for _ in range(rank))

    ranks = [nd, nd, nd]
    if rng.random() < 0.15:
        ranks[rng.randrange(3)] = rng.choice([2, 3, 4, 5])
    q, k = list(shape(ranks[0])), list(shape(ranks[1]))
    if rng.random() < 0.7 and len(q) == len(k) == nd:  # mostly valid-looking: share batch, head dim, heads
        k[-1] = q[-1]
        if not varlen:
            k[0] = q[0]
        k[-2] = rng.choice([h for h in sizes if q[-2] % h == 0])
    v = list(k) if ranks[2] == ranks[1] else list(shape(ranks[2]))
    if rng.random() < 0.3 and v:
        v[-1] = rng.choice([1, 2, 3, 4, 256, 257])
    if rng.random() < 0.15:
        q[-1] = k[-1] = rng.choice([256, 257, 0])
        if v:
            v[-1] = rng.choice([v[-1], q[-1]])
    if rng.random() < 0.15 and v:
        v[rng.randrange(len(v))] += 1
    dtypes = [F16] * 3
    if rng.random() < 0.1:
        dtypes = [torch.int32] * 3
    elif rng.random() < 0.1:
        dtypes[rng.randrange(3)] = torch.float32
    contiguous = [rng.random() > 0.1 for _ in range(3)]
    devices = ["cpu"] * 3
    if rng.random() < 0.05:
        devices[rng.randrange(1, 3)] = "meta"
    return tuple(_tensor(tuple(s), dt, c, dev) for s, dt, c, dev in zip((q, k, v), dtypes, contiguous, devices))


@pytest.mark.parametrize("varlen", [False, True])
def test_qkv_follows_the_rules_on_coinciding_shapes(varlen):
    rng = random.Random(1234 + varlen)
    accepted = rejected = 0
    for _ in range(3000):
        q, k, v = _random_case(rng, varlen)
        want = _rule(q, k, v, varlen)
        try:
            got = _checks.qkv(q, k, v, varlen)
        except (TypeError, ValueError) as e:
            assert want is type(e), (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, e)
            rejected += 1
            continue
        assert want is None, (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype,
                              q.stride(), k.stride(), v.stride(), "accepted")
        assert got == (q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1])
        accepted += 1
    assert accepted > 300 and rejected > 300  # both sides of every rule get exercised


def _perturbations(q, k, v):
    """Inputs one step from the valid (q, k, v): a dimension of 1 inserted, the last two dims' storage swapped,
    a layout whose stride 1 is on another dimension."""
    out = []
    for i in range(3):
        t = [q, k, v]
        for j in range(t[i].dim() + 1):
            u = list(t)
            u[i] = t[i].unsqueeze(j)
            out.append(u)
        u = list(t)
        u[i] = t[i].transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-2) == 1
        out.append(u)
        u = list(t)
        u[i] = t[i].permute(*range(t[i].dim() - 1, -1, -1)).contiguous().permute(*range(t[i].dim() - 1, -1, -1))
        out.append(u)  # column-major: stride(0) == 1
    out.append([q, k.unsqueeze(-2), v.unsqueeze(-2)])  # k and v agree with each other, not with q
    out.append([q, k[..., 0, :], v[..., 0, :]])
    return out


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 2, 2, 2), (3, 5, 1, 1), (2, 1, 4, 256)])
def test_qkv_follows_the_rules_one_step_from_a_valid_call(varlen, shape):
    q = torch.zeros(shape if not varlen else shape[1:], dtype=F16)
    kshape = (*q.shape[:-2], max(1, q.shape[-2] // 2), q.shape[-1])
    k, v = torch.zeros(kshape, dtype=F16), torch.zeros(kshape, dtype=F16)
    assert _rule(q, k, v, varlen) is None
    for case in _perturbations(q, k, v):
        want = _rule(*case, varlen)
        try:
            got = _checks.qkv(*case, varlen)
        except (TypeError, ValueError) as e:
            assert want is type(e), ([tuple(t.shape) for t in case], [t.stride() for t in case], e)
            continue
        assert want is None, ([tuple(t.shape) for t in case], [t.stride() for t in case], "accepted")
        assert got == (case[0].shape[-2], case[1].shape[-2], case[0].shape[-1], case[2].shape[-1])


@pytest.mark.parametrize("d,dv", [(256, 256), (1, 1), (1, 256)])
def test_varlen_paged_layout_takes_the_full_checks_at_the_head_dim_bounds(d, dv):
    # a varlen call with 4-D (paged) k / v misses the one-pass acceptance: the full checks must accept it too
    q = torch.zeros(10, 4, d, dtype=F16)
    k, v = torch.zeros(3, 16, 2, d, dtype=F16), torch.zeros(3, 16, 2, dv, dtype=F16)
    assert _checks.qkv(q, k, v, True) == (4, 2, d, dv)
    assert _checks.qkv_shapes(q, k, v, True) == (q.shape, k.shape, v.shape)  # (from the full checks)


@pytest.mark.parametrize("q,k,v", [
    ((2, 3, 4, 4), (2, 3, 4, 4), (2, 3, 4, 4)),          # every size a candidate for the wrong dimension
    ((2, 2, 2, 2), (2, 2, 1, 2), (2, 2, 1, 2)),
    ((1, 5, 6, 1), (1, 5, 3, 1), (1, 5, 3, 1)),          # head dim 1 with odd strides below
    ((3, 1, 4, 256), (3, 7, 2, 256), (3, 7, 2, 256)),
])
def test_qkv_returns_heads_and_head_dims(q, k, v):
    tq, tk, tv = (torch.zeros(s, dtype=F16) for s in (q, k, v))
    assert _checks.qkv(tq, tk, tv, False) == (q[2], k[2], q[3], v[3])
    assert _checks.qkv_shapes(tq, tk, tv, False) == (q, k, v)  # (from the one-pass acceptance)
    if q[3] == 1:  # a last dim of size 1 may have any stride
        odd = [torch.zeros(s, dtype=F16).as_strided(s, (*torch.zeros(s).stride()[:-1], 5)) for s in (q, k, v)]
        assert all(t.stride(-1) == 5 for t in odd)
        assert _checks.qkv(*odd, False) == (q[2], k[2], 1, 1)


# ----------------------------------------------------------------------------------------------------
# Messages name the argument and what was expected


@pytest.mark.parametrize("args,error,message", [
    ((["x"], F16), TypeError, r"^q must be a torch.Tensor, got list$"),
    ((torch.zeros(2, dtype=torch.int64), None), TypeError,
     r"^q must have dtype float16, bfloat16, float32; got int64$"),
    ((torch.zeros(2, 3), 4), ValueError, r"^q must have 4 dims, got shape \(2, 3\)$"),
])
def test_tensor_messages(args, error, message):
    t, ndim = args
    with pytest.raises(error, match=message):
        _checks.tensor("q", t, ndim)


def test_tensor_device_message():
    with pytest.raises(ValueError, match=r"^k is on meta but q is on cpu; all tensors must share a device$"):
        _checks.tensor("k", torch.zeros(2, device="meta"), None, device=torch.device("cpu"))


def _qkv_error(q, k, v, varlen=False):
    with pytest.raises((TypeError, ValueError)) as info:
        _checks.qkv(q, k, v, varlen)
    return str(info.value)


def z(*shape, dtype=F16):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("case,message", [
    (lambda: (z(1, 4, 2, 8), z(4, 2, 8), z(4, 2, 8)), r"^k must have 4 dims, got shape \(4, 2, 8\)$"),
    (lambda: (z(1, 4, 2, 8), z(1, 4, 2, 8), z(4, 2, 8)), r"^v must have as many dims as k \(4\), got shape \(4, 2, 8\)$"),
    (lambda: (z(1, 4, 2, 8), z(1, 4, 2, 8), z(1, 4, 2, 8, dtype=torch.float32)),
     r"^q, k, v must share a dtype; got torch.float16, torch.float16, torch.float32$"),
    (lambda: (z(1, 4, 2, 8), z(1, 4, 2, 16)[..., ::2], z(1, 4, 2, 8)), r"^k must be contiguous in its last dimension"),
    (lambda: (z(1, 4, 2, 8), z(1, 4, 2, 8), z(1, 4, 2, 16)[..., ::2]), r"^v must be contiguous in its last dimension"),
    (lambda: (z(1, 4, 2, 16)[..., ::2], z(1, 4, 2, 8), z(1, 4, 2, 8)), r"^q must be contiguous in its last dimension"),
    (lambda: (z(1, 4, 2, 8), z(1, 4, 2, 4), z(1, 4, 2, 4)), r"^k head dim 4 must equal q head dim 8$"),
    (lambda: (z(1, 4, 2, 8), z(1, 4, 2, 8), z(1, 5, 2, 8)),
     r"^v shape \(1, 5, 2, 8\) must match k shape \(1, 4, 2, 8\) except the last dim$"),
    (lambda: (z(3, 4, 2, 8), z(2, 4, 2, 8), z(2, 4, 2, 8)), r"^batch size of k \(2\) must equal batch size of q \(3\)$"),
    (lambda: (z(1, 4, 3, 8), z(1, 4, 2, 8), z(1, 4, 2, 8)),
     r"^number of query heads \(3\) must be a multiple of key/value heads \(2\)$"),
    (lambda: (z(1, 4, 2, 300), z(1, 4, 2, 300), z(1, 4, 2, 8)), r"^head dim must be in 1..256, got 300$"),
    (lambda: (z(1, 4, 2, 8), z(1, 4, 2, 8), z(1, 4, 2, 257)), r"^v head dim must be in 1..256, got 257$"),
    (lambda: (z(1, 4, 2, 8), z(1, 4, 2, 8), z(1, 4, 2, 0)), r"^v head dim must be in 1..256, got 0$"),
    (lambda: (z(1, 4, 2, 8), z(1, 4, 2, 8), torch.zeros(1, 4, 2, 8, device="meta", dtype=F16)),
     r"^v is on meta but q is on cpu"),
])
def test_qkv_messages(case, message):
    msg = _qkv_error(*case())
    assert re.search(message, msg), msg


def test_head_dims_at_the_bounds_are_accepted():
    assert _checks.qkv(z(1, 2, 1, 256), z(1, 2, 1, 256), z(1, 2, 1, 1), False) == (1, 1, 256, 1)
    assert _checks.qkv(z(1, 2, 1, 1), z(1, 2, 1, 1), z(1, 2, 1, 256), False) == (1, 1, 1, 256)
    assert _checks.qkv(z(3, 1, 256), z(3, 1, 256), z(3, 1, 256), True) == (1, 1, 256, 256)


def test_last_dim_contiguity_ignores_a_last_dim_of_one():
    t = torch.zeros(4, 1, 3).transpose(1, 2)  # shape (4, 3, 1), stride(-1) == 3
    assert t.stride(-1) != 1
    _checks.last_dim_contiguous("q", t)
    with pytest.raises(ValueError, match=r"^q must be contiguous in its last dimension \(stride\(-1\) == 1\); "
                                         r"got strides \(6, 1, 3\); call .contiguous\(\)$"):
        _checks.last_dim_contiguous("q", torch.zeros(4, 2, 3).transpose(1, 2))
    _checks.last_dim_contiguous("q", torch.zeros(()))  # a 0-d tensor has no last dimension


def test_scalars():
    assert _checks.scalars(0.0, 0.0, None, 16) == 0.25
    s = _checks.scalars(0.0, 0.0, 2, 16)
    assert s == 2.0 and type(s) is float
    with pytest.raises(ValueError, match=r"^softcap and dropout_p > 0 cannot be combined$"):
        _checks.scalars(0.1, 0.5, None, 16)
    with pytest.raises(ValueError, match=r"^dropout_p must be in \[0, 1\), got 1.0$"):
        _checks.scalars(1.0, 0.0, None, 16)
    with pytest.raises(ValueError, match=r"^softcap must be >= 0 \(0: off\), got -0.5$"):
        _checks.scalars(0.0, -0.5, None, 16)


def test_alibi():
    s = torch.zeros(4)
    assert _checks.alibi(None, 2, 4, torch.device("cpu")) is None
    assert _checks.alibi(s, 2, 4, torch.device("cpu")) is s
    assert _checks.alibi(torch.zeros(2, 4), 2, 4, torch.device("cpu")).shape == (2, 4)
    with pytest.raises(ValueError, match=r"^alibi_slopes is on meta but q is on cpu"):
        _checks.alibi(torch.zeros(4, device="meta"), 2, 4, torch.device("cpu"))
    with pytest.raises(TypeError, match=r"^alibi_slopes must have dtype float32; got float16$"):
        _checks.alibi(s.half(), 2, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^alibi_slopes must have shape \(4,\) or \(2, 4\), got \(4, 2\)$"):
        _checks.alibi(torch.zeros(4, 2), 2, 4, torch.device("cpu"))


# ----------------------------------------------------------------------------------------------------
# int32 vectors and cu_seqlens


def test_int32_vector():
    cpu = torch.device("cpu")
    v = torch.zeros(3, dtype=torch.int32)
    assert _checks.int32_vector("cache_seqlens", v, 3, cpu) is v
    assert _checks.int32_vector("cache_seqlens", v, None, cpu) is v
    with pytest.raises(ValueError, match=r"^cache_seqlens must have length 2, got 3$"):
        _checks.int32_vector("cache_seqlens", v, 2, cpu)
    with pytest.raises(ValueError, match=r"^cache_seqlens must have 1 dims, got shape \(3, 1\)$"):
        _checks.int32_vector("cache_seqlens", v[:, None], 3, cpu)
    with pytest.raises(ValueError, match=r"^cache_seqlens is on meta but q is on cpu"):
        _checks.int32_vector("cache_seqlens", torch.zeros(3, dtype=torch.int32, device="meta"), 3, cpu)
    with pytest.raises(TypeError, match=r"^cache_seqlens must have dtype int32; got int64$"):
        _checks.int32_vector("cache_seqlens", v.long(), 3, cpu)


def test_cu_seqlens_shape():
    cpu = torch.device("cpu")
    one = torch.zeros(1, dtype=torch.int32)  # batch 0
    assert _checks.cu_seqlens("cu_seqlens_q", one, cpu) is one
    with pytest.raises(ValueError, match=r"^cu_seqlens_q must have length batch \+ 1 >= 1, got 0$"):
        _checks.cu_seqlens("cu_seqlens_q", torch.zeros(0, dtype=torch.int32), cpu)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q must have 1 dims"):
        _checks.cu_seqlens("cu_seqlens_q", torch.zeros(2, 1, dtype=torch.int32), cpu)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k is on meta"):
        _checks.cu_seqlens("cu_seqlens_k", torch.zeros(2, dtype=torch.int32, device="meta"), cpu)


@pytest.fixture(params=["list", "reduced"])
def value_path(request, monkeypatch):
    """The value checks' two ways: small tensors read whole into a Python list, larger ones reduced on their device."""
    monkeypatch.setattr(_checks, "_LIST_VALUES", 256 if request.param == "list" else 0)
    return request.param


def test_cu_seqlens_values_of_an_empty_batch(value_path):
    _checks.cu_seqlens_values("cu_seqlens_q", torch.zeros(1, dtype=torch.int32), 0, 0)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q must start at 0, got 3$"):
        _checks.cu_seqlens_values("cu_seqlens_q", torch.full((1,), 3, dtype=torch.int32), 5, 0)


def test_cu_seqlens_values_in_64_bits(value_path):
    # int32 arithmetic would wrap 2**31 - 1 -> -2**31 around to a difference of +1
    cu = torch.tensor([0, 2**31 - 1, -2**31], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k must be non-decreasing"):
        _checks.cu_seqlens_values("cu_seqlens_k", cu, None, 2**31)


def test_cu_seqlens_values_messages(value_path):
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k\[-1\] = 7 exceeds the number of tokens \(6\)$"):
        _checks.cu_seqlens_values("cu_seqlens_k", cu, 6, 4)
    with pytest.raises(ValueError, match=r"^max_seqlen \(3\) is smaller than the longest sequence in cu_seqlens_k \(4\)$"):
        _checks.cu_seqlens_values("cu_seqlens_k", cu.clone(), 7, 3)
    _checks.cu_seqlens_values("cu_seqlens_k", cu.clone(), 7, 4)
    _checks.cu_seqlens_values("cu_seqlens_k", cu.clone(), None, 4)


def test_cu_seqlens_values_are_checked_again_for_other_bounds(value_path):
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    _checks.cu_seqlens_values("cu_seqlens_q", cu, 7, 4)
    with pytest.raises(ValueError, match="max_seqlen"):
        _checks.cu_seqlens_values("cu_seqlens_q", cu, 7, 3)  # the same tensor, a smaller max_seqlen
    with pytest.raises(ValueError, match="exceeds the number of tokens"):
        _checks.cu_seqlens_values("cu_seqlens_q", cu, 6, 4)


def test_range_values(value_path):
    t = torch.tensor([0, 5, 9])
    _checks.range_values("block_table", t, 0, 10)
    with pytest.raises(ValueError, match=r"^block_table values must be in \[0, 9\), got min 0, max 9$"):
        _checks.range_values("block_table", t, 0, 9)  # same tensor, another bound: checked again
    with pytest.raises(RuntimeError, match=r"^x values must be in \[1, 10\) \(pages\), got min 0, max 9$"):
        _checks.range_values("x", t.clone(), 1, 10, error=RuntimeError, why=" (pages)")
    _checks.range_values("x", torch.zeros(0, dtype=torch.int64), 0, 1)


# ----------------------------------------------------------------------------------------------------
# The cache of value checks


def _counting_check():
    calls = []
    return calls, lambda: calls.append(1)


def test_a_value_check_runs_once_per_tensor_version_and_key():
    t = torch.zeros(3)
    calls, check = _counting_check()
    _checks._cached(t, "a", check)
    _checks._cached(t, "a", check)
    assert len(calls) == 1
    _checks._cached(t, "b", check)  # another key (e.g. another bound)
    assert len(calls) == 2
    t.add_(1)  # a new version
    _checks._cached(t, "b", check)
    _checks._cached(t, "b", check)
    assert len(calls) == 3
    other = torch.zeros(3)  # another tensor with equal contents is checked on its own
    _checks._cached(other, "b", check)
    assert len(calls) == 4


def test_a_failed_check_is_not_cached():
    t = torch.zeros(3)

    def bad():
        raise ValueError("no")

    for _ in range(2):
        with pytest.raises(ValueError):
            _checks._cached(t, "k", bad)


def test_inference_tensors_are_checked_every_time():
    with torch.inference_mode():
        t = torch.zeros(3)
    calls, check = _counting_check()
    _checks._cached(t, "a", check)
    _checks._cached(t, "a", check)
    assert len(calls) == 2
    _checks.trust(t)  # no version counter: nothing to trust either
    _checks._cached(t, "a", check)
    assert len(calls) == 3


def test_trusted_tensors_skip_their_checks_until_they_die():
    t = _checks.trust(torch.zeros(3))
    calls, check = _counting_check()
    _checks._cached(t, "a", check)
    _checks._cached(t, "b", check)
    assert calls == []
    other = torch.zeros(3)
    _checks._cached(other, "a", check)
    assert calls == [1]  # trust is per tensor object


def test_cache_entries_leave_with_their_tensor():
    before = len(_checks._seen)
    ts = [torch.zeros(2) for _ in range(5)]
    for i, t in enumerate(ts):
        if i % 2:
            _checks.trust(t)
        else:
            _checks._cached(t, "a", lambda: None)
    assert len(_checks._seen) == before + 5
    entries = [_checks._seen[id(t)] for t in ts]
    assert all(e[1]() is t for e, t in zip(entries, ts))  # each entry holds a weak reference to its own tensor
    del ts, entries, t
    gc.collect()
    assert len(_checks._seen) == before


def test_a_new_tensor_at_a_dead_ones_address_is_checked():
    # ids are reused after a tensor dies: the weakref callback must drop its entry first
    calls, check = _counting_check()
    for _ in range(20):
        t = torch.zeros(3)
        _checks._cached(t, "a", check)
        del t
    assert len(calls) == 20
    for _ in range(20):
        t = _checks.trust(torch.zeros(3))
        del t
        u = torch.zeros(3)
        _checks._cached(u, "z", check)
        del u
    assert len(calls) == 40
