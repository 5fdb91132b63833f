import torch

from flash_attn.bert_padding import (index_first_axis, index_put_first_axis, pad_input, unpad_input,
                                     unpad_input_for_concatenated_sequences)


def test_unpad_pad_roundtrip_and_metadata():
    x = torch.randn(3, 5, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    xu, idx, cu, maxlen, used = unpad_input(x, mask)
    assert xu.shape == (8, 4)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 8]
    assert maxlen == 5 and used.tolist() == [3, 0, 5]
    back = pad_input(xu, idx, 3, 5)
    torch.testing.assert_close(back, x * mask[..., None])
    back.sum().backward()
    torch.testing.assert_close(x.grad, mask[..., None].float().expand_as(x))


def test_unpad_with_unused_mask_counts_only_used_tokens():
    x = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]])
    xu, idx, cu, maxlen, used = unpad_input(x, mask, unused)
    assert cu.tolist() == [0, 3, 6] and used.tolist() == [2, 1] and maxlen == 3
    torch.testing.assert_close(xu[3:], x[1, :3])


def test_index_first_axis_and_put_are_inverse():
    x = torch.randn(6, 2, 3)
    idx = torch.tensor([4, 0, 5])
    y = index_first_axis(x, idx)
    torch.testing.assert_close(y, x[idx])
    z = index_put_first_axis(y, idx, 6)
    torch.testing.assert_close(z[idx], x[idx])
    assert (z[[1, 2, 3]] == 0).all()


def test_unpad_concatenated_sequences():
    x = torch.arange(2 * 6, dtype=torch.float32).view(2, 6, 1)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [4, 0, 0, 0, 0, 0]])
    xu, idx, cu, maxlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 9] and maxlen == 4
    assert xu.flatten().tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9]


def test_fa2_autograd_classes():
    """FA2's IndexFirstAxis / IndexPutFirstAxis / index_first_axis_residual: values and gradients (gradcheck), and the
    residual form's gradient reaching every row of its input."""
    from flash_attn.bert_padding import IndexFirstAxis, IndexPutFirstAxis, index_first_axis, index_first_axis_residual

    x = torch.randn(6, 3, 2, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 3, 2, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([4, 0, 2])
    assert torch.equal(IndexFirstAxis.apply(x, idx), x[idx])
    assert torch.equal(IndexPutFirstAxis.apply(v, idx, 6)[idx], v) and IndexPutFirstAxis.apply(v, idx, 6)[1].eq(0).all()
    assert torch.autograd.gradcheck(lambda t: IndexFirstAxis.apply(t, idx), (x,))
    assert torch.autograd.gradcheck(lambda t: IndexPutFirstAxis.apply(t, idx, 6), (v,))
    assert torch.autograd.gradcheck(lambda t: index_first_axis_residual(t, idx), (x,))
    gathered, residual = index_first_axis_residual(x, idx)
    (2 * gathered.sum() + (residual * residual).sum()).backward()
    want = x.detach() * 2
    want[idx] += 2
    torch.testing.assert_close(x.grad, want)
    assert torch.equal(index_first_axis(x, idx), gathered)


def test_unpad_returns_int32_seqused_and_keeps_trailing_dims():
    """seqused is int32 like cu_seqlens (kernels read both as int32); a (B, S, H, D) input keeps (H, D)."""
    x = torch.randn(2, 4, 3, 5)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    xu, idx, cu, maxlen, used = unpad_input(x, mask)
    assert used.dtype == torch.int32 and used.tolist() == [3, 1]
    assert xu.shape == (4, 3, 5)
    torch.testing.assert_close(xu, torch.cat([x[0, :3], x[1, :1]]))


def test_unpad_of_an_empty_batch_has_max_seqlen_zero():
    xu, idx, cu, maxlen, used = unpad_input(torch.randn(0, 4, 2), torch.zeros(0, 4, dtype=torch.bool))
    assert xu.shape == (0, 2) and cu.tolist() == [0] and maxlen == 0 and used.numel() == 0
    xu, idx, cu, maxlen = unpad_input_for_concatenated_sequences(torch.randn(0, 4, 2), torch.zeros(0, 4, dtype=torch.int64))
    assert xu.shape == (0, 2) and cu.tolist() == [0] and maxlen == 0


def test_unpad_concatenated_sequences_keeps_one_token_sequences_and_head_dims():
    x = torch.randn(2, 5, 2, 3)
    lengths = torch.tensor([[1, 3, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.int32)
    xu, idx, cu, maxlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 1, 4, 5, 6, 7] and maxlen == 3
    assert xu.shape == (7, 2, 3)
    torch.testing.assert_close(xu, torch.cat([x[0, :4], x[1, :3]]))


def test_index_first_axis_residual_backward_with_the_residual_unused():
    """Only the gathered rows reach the loss: the gradient is zero elsewhere and has the input's shape."""
    from flash_attn.bert_padding import index_first_axis_residual

    x = torch.randn(5, 2, 3, requires_grad=True)
    idx = torch.tensor([3, 1])
    gathered, _ = index_first_axis_residual(x, idx)
    (gathered * 3).sum().backward()
    want = torch.zeros(5, 2, 3)
    want[idx] = 3
    torch.testing.assert_close(x.grad, want)


def test_index_first_axis_residual_backward_with_a_non_contiguous_residual_gradient():
    """The residual's gradient arrives transposed (a non-contiguous view); the gathered rows' gradient must still
    be added into it, not into a temporary copy."""
    from flash_attn.bert_padding import index_first_axis_residual

    x = torch.randn(4, 3, 2, requires_grad=True)
    w = torch.randn(4, 2, 3)
    idx = torch.tensor([2, 0])
    gathered, residual = index_first_axis_residual(x, idx)
    ((residual.transpose(1, 2) * w).sum() + gathered.sum()).backward()
    want = w.transpose(1, 2).clone()
    want[idx] += 1
    torch.testing.assert_close(x.grad, want)
