"""Bad input gets a clear exception naming the argument, never a crash or a silently wrong answer."""
import pytest
import torch

from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache


def t(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype)


def test_wrong_dtype():
    with pytest.raises(TypeError, match="q must have dtype"):
        flash_attn_func(t(1, 4, 2, 8, dtype=torch.float64), t(1, 4, 2, 8), t(1, 4, 2, 8))


def test_mixed_dtypes():
    with pytest.raises(TypeError, match="share a dtype"):
        flash_attn_func(t(1, 4, 2, 8), t(1, 4, 2, 8, dtype=torch.bfloat16), t(1, 4, 2, 8))


def test_not_a_tensor():
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        flash_attn_func(t(1, 4, 2, 8), [1, 2], t(1, 4, 2, 8))


def test_wrong_rank():
    with pytest.raises(ValueError, match="q must have 4 dims"):
        flash_attn_func(t(4, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8))


def test_batch_mismatch():
    with pytest.raises(ValueError, match="batch size of k"):
        flash_attn_func(t(2, 4, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8))


def test_heads_not_divisible():
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flash_attn_func(t(1, 4, 3, 8), t(1, 4, 2, 8), t(1, 4, 2, 8))


def test_head_dim_mismatch():
    with pytest.raises(ValueError, match="k head dim 16 must equal q head dim 8"):
        flash_attn_func(t(1, 4, 2, 8), t(1, 4, 2, 16), t(1, 4, 2, 16))


def test_v_shape_mismatch():
    with pytest.raises(ValueError, match="v shape"):
        flash_attn_func(t(1, 4, 2, 8), t(1, 4, 2, 8), t(1, 5, 2, 8))


def test_head_dim_over_256():
    with pytest.raises(ValueError, match="head dim must be in 1..256"):
        flash_attn_func(t(1, 2, 1, 264), t(1, 2, 1, 264), t(1, 2, 1, 264))


def test_last_dim_not_contiguous():
    q = t(1, 4, 2, 16)[..., ::2]
    with pytest.raises(ValueError, match="q must be contiguous in its last dimension"):
        flash_attn_func(q, t(1, 4, 2, 8), t(1, 4, 2, 8))


def test_other_strides_are_fine():
    q = t(1, 2, 4, 8).transpose(1, 2)  # (1, 4, 2, 8), non-contiguous but last dim stride 1
    out = flash_attn_func(q, q, q)
    assert out.shape == (1, 4, 2, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device type")
def test_different_devices():
    with pytest.raises(ValueError, match="k is on"):
        flash_attn_func(t(1, 4, 2, 8).cuda(), t(1, 4, 2, 8), t(1, 4, 2, 8))


def test_different_devices_meta():
    # a CPU-only stand-in for the device check: meta tensors are another device
    with pytest.raises(ValueError, match="k is on meta"):
        flash_attn_func(t(1, 4, 2, 8), torch.empty(1, 4, 2, 8, dtype=torch.float16, device="meta"),
                        t(1, 4, 2, 8))


def test_softcap_with_dropout():
    with pytest.raises(ValueError, match="softcap and dropout_p"):
        flash_attn_func(t(1, 4, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8), dropout_p=0.1, softcap=5.0)


def test_dropout_out_of_range():
    with pytest.raises(ValueError, match="dropout_p must be in"):
        flash_attn_func(t(1, 4, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8), dropout_p=1.0)


def test_bad_window():
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(t(1, 4, 2, 8), t(1, 4, 2, 8), t(1, 4, 2, 8), window_size=(-2, 0))


def test_bad_alibi_shape_and_dtype():
    q = t(1, 4, 2, 8)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flash_attn_func(q, q, q, alibi_slopes=torch.rand(3))
    with pytest.raises(TypeError, match="alibi_slopes must have dtype float32"):
        flash_attn_func(q, q, q, alibi_slopes=torch.rand(2).half())


def _varlen(cu_q=None, cu_k=None, max_q=4, max_k=4, total=8):
    q = t(total, 2, 8)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    return flash_attn_varlen_func(q, q, q, cu if cu_q is None else cu_q, cu if cu_k is None else cu_k,
                                  max_q, max_k)


def test_cu_seqlens_not_int32():
    with pytest.raises(TypeError, match="cu_seqlens_q must have dtype int32"):
        _varlen(cu_q=torch.tensor([0, 4, 8]))


def test_cu_seqlens_decreasing():
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        _varlen(cu_k=torch.tensor([0, 6, 5], dtype=torch.int32), max_k=6)


def test_cu_seqlens_not_starting_at_zero():
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        _varlen(cu_q=torch.tensor([1, 4, 8], dtype=torch.int32))


def test_cu_seqlens_past_the_end():
    with pytest.raises(ValueError, match="exceeds the number of tokens"):
        _varlen(cu_q=torch.tensor([0, 4, 9], dtype=torch.int32), max_q=5)


def test_cu_seqlens_wrong_length():
    with pytest.raises(ValueError, match="cu_seqlens_k must have length 3"):
        _varlen(cu_k=torch.tensor([0, 8], dtype=torch.int32))


def test_max_seqlen_too_small():
    with pytest.raises(ValueError, match="max_seqlen .* smaller than the longest sequence"):
        _varlen(max_q=3)


def test_block_table_out_of_range():
    q = t(8, 2, 8)
    k_paged = t(3, 4, 2, 8)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    table = torch.tensor([[0], [3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table values must be in \[0, 3\)"):
        flash_attn_varlen_func(q, k_paged, k_paged, cu, cu, 4, 4, block_table=table)


def test_kvcache_seqlens_out_of_range():
    q, cache, new = t(2, 1, 2, 8), t(2, 6, 2, 8), t(2, 1, 2, 8)
    with pytest.raises(ValueError, match=r"cache_seqlens values must be in \[0, 6\)"):
        flash_attn_with_kvcache(q, cache, cache.clone(), new, new, cache_seqlens=torch.tensor(
            [2, 6], dtype=torch.int32))


@pytest.mark.parametrize("append", [False, True])
def test_kvcache_seqlens_beyond_the_block_table(append):
    # FA2's test_flash_attn_kvcache_paged_block_table_bounds: RuntimeError naming block_table (here also a ValueError,
    # as the other value checks); exactly at capacity passes
    q, pages = t(1, 1, 1, 8), t(4, 8, 1, 8)
    table = torch.zeros(1, 1, dtype=torch.int32)
    new = t(1, 1, 1, 8) if append else None
    for seqlens in (torch.tensor([8 if append else 9], dtype=torch.int32), 8 if append else 9):
        with pytest.raises(RuntimeError, match="block_table") as e:
            flash_attn_with_kvcache(q, pages, pages.clone(), new, new, cache_seqlens=seqlens, block_table=table)
        assert isinstance(e.value, ValueError)
    out = flash_attn_with_kvcache(q, pages, pages.clone(), cache_seqlens=torch.tensor([8], dtype=torch.int32),
                                  block_table=table)
    assert out.shape == (1, 1, 1, 8) and not out.isnan().any()


def test_kvcache_seqlens_not_int32():
    q, cache = t(2, 1, 2, 8), t(2, 6, 2, 8)
    with pytest.raises(TypeError, match="cache_seqlens must have dtype int32"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([2, 3]))


def test_kvcache_block_table_out_of_range():
    q, cache = t(2, 1, 2, 8), t(4, 4, 2, 8)
    table = torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_table values"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([3, 3], dtype=torch.int32),
                                block_table=table)


def test_kvcache_batch_idx_out_of_range():
    q, cache = t(2, 1, 2, 8), t(3, 4, 2, 8)
    with pytest.raises(ValueError, match="cache_batch_idx values"):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=2,
                                cache_batch_idx=torch.tensor([0, 3], dtype=torch.int32))


def test_kvcache_k_without_v():
    q, cache = t(2, 1, 2, 8), t(2, 4, 2, 8)
    with pytest.raises(ValueError, match="k and v must be given together"):
        flash_attn_with_kvcache(q, cache, cache, k=t(2, 1, 2, 8), cache_seqlens=1)


def test_kvcache_rotary_without_new_kv():
    q, cache = t(2, 1, 2, 8), t(2, 4, 2, 8)
    cos = torch.ones(8, 4)
    with pytest.raises(ValueError, match="pass k and v too"):
        flash_attn_with_kvcache(q, cache, cache, rotary_cos=cos, rotary_sin=cos, cache_seqlens=1)


def test_kvcache_int_seqlens_out_of_range():
    q, cache, new = t(2, 1, 2, 8), t(2, 6, 2, 8), t(2, 2, 2, 8)
    with pytest.raises(ValueError, match=r"cache_seqlens \(5\) must be in \[0, 4\]"):
        flash_attn_with_kvcache(q, cache, cache.clone(), new, new, cache_seqlens=5)


def test_value_checks_run_under_inference_mode():
    q, cache = t(2, 1, 2, 8), t(2, 6, 2, 8)
    with torch.inference_mode():
        out = flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([2, 6], dtype=torch.int32))
        assert out.shape == q.shape
        with pytest.raises(ValueError, match="cache_seqlens values"):
            flash_attn_with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([2, 7], dtype=torch.int32))


def test_value_check_reruns_after_in_place_change():
    q = t(8, 2, 8)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    flash_attn_varlen_func(q, q, q, cu, cu, 4, 4)
    cu[1] = 9  # same tensor object, new contents: must be checked again
    with pytest.raises(ValueError, match="non-decreasing|exceeds"):
        flash_attn_varlen_func(q, q, q, cu, cu, 9, 9)


def _bad_calls():
    ok = t(1, 4, 2, 8)
    meta = torch.empty(1, 4, 2, 8, dtype=torch.float16, device="meta")
    return {
        "q not a tensor": ((ok.tolist(), ok, ok), {}),
        "int dtype": ((ok.to(torch.int32), ok, ok), {}),
        "v dtype": ((ok, ok, ok.float()), {}),
        "q rank": ((t(4, 2, 8), ok, ok), {}),
        "v rank": ((ok, ok, t(4, 2, 8)), {}),
        "batch": ((ok, t(2, 4, 2, 8), t(2, 4, 2, 8)), {}),
        "heads": ((t(1, 4, 3, 8), ok, ok), {}),
        "zero kv heads": ((ok, t(1, 4, 0, 8), t(1, 4, 0, 8)), {}),
        "k head dim": ((ok, t(1, 4, 2, 16), t(1, 4, 2, 16)), {}),
        "head dim 0": ((t(1, 4, 2, 0), t(1, 4, 2, 0), t(1, 4, 2, 0)), {}),
        "v head dim 300": ((ok, ok, t(1, 4, 2, 300)), {}),
        "v seqlen": ((ok, ok, t(1, 5, 2, 8)), {}),
        "k last dim": ((ok, t(1, 4, 2, 16)[..., ::2], ok), {}),
        "v last dim": ((ok, ok, t(1, 4, 2, 16)[..., ::2]), {}),
        "device": ((ok, ok, meta), {}),
        "window": ((ok, ok, ok), dict(window_size=(-2, 0))),
        "window type": ((ok, ok, ok), dict(window_size=3)),
        "negative softcap": ((ok, ok, ok), dict(softcap=-1.0)),
        "dropout nan": ((ok, ok, ok), dict(dropout_p=float("nan"))),
    }


@pytest.mark.parametrize("case", sorted(_bad_calls()))
def test_common_call_path_checks_like_the_general_one(case):
    # flash_attn_func takes a shorter path for calls without dropout/softcap/ALiBi/probabilities;
    # return_attn_probs=True forces the general one. Both must raise the same error.
    args, kwargs = _bad_calls()[case]
    errors = []
    for extra in ({}, dict(return_attn_probs=True)):
        with pytest.raises((TypeError, ValueError)) as info:
            flash_attn_func(*args, **kwargs, **extra)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]
