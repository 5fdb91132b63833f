"""The LayerNorm / RMSNorm PyTorch path (ops/triton/layer_norm_torch.py) beyond what test_layer_norm.py compares:
its dropout mask at the threshold's equality case and on the inputs' device (meta tensors show a mask built
elsewhere), and the parallel residual's second weight without a second bias."""
import pytest
import torch

import flash_attn
from flash_attn.dropout import hash32, threshold
from flash_attn.ops.triton import layer_norm_torch as lnt
from flash_attn.ops.triton.layer_norm import layer_norm_fn, layer_norm_ref


@pytest.fixture(autouse=True)
def torch_path():
    with flash_attn.use_backend("torch"):
        yield


def test_keep_mask_is_built_on_the_requested_device():
    keep = lnt._keep_mask_torch(torch.tensor([3, 4]), 0, 2, 5, 0.5, torch.device("meta"))
    assert keep.device.type == "meta" and keep.shape == (2, 5) and keep.dtype == torch.bool


def test_keep_mask_keeps_a_hash_equal_to_the_threshold():
    seeds = torch.tensor([5, 6])
    u = int(hash32(hash32(hash32(torch.tensor(7) ^ 5) ^ 6) ^ 2))  # row 7, column 2
    assert threshold(u / 2**32) == u
    assert bool(lnt._keep_mask_torch(seeds, 7, 1, 3, u / 2**32, torch.device("cpu"))[0, 2])
    assert not bool(lnt._keep_mask_torch(seeds, 7, 1, 3, (u + 1) / 2**32, torch.device("cpu"))[0, 2])


@pytest.mark.parametrize("is_rms_norm", [False, True])
def test_dropout_forward_and_backward_stay_on_the_inputs_device(is_rms_norm):
    x = torch.randn(4, 8, device="meta", requires_grad=True)
    x1 = torch.randn(4, 8, device="meta", requires_grad=True)
    w = torch.ones(8, device="meta", requires_grad=True)
    w1 = torch.ones(8, device="meta", requires_grad=True)
    out = layer_norm_fn(x, w, None if is_rms_norm else torch.zeros(8, device="meta"), x1=x1, weight1=w1,
                        dropout_p=0.25, is_rms_norm=is_rms_norm, return_dropout_mask=True)
    assert all(t.device.type == "meta" for t in out)
    (out[0].sum() + out[1].sum()).backward()
    assert x.grad.device.type == "meta" and x1.grad.device.type == "meta" and w1.grad.device.type == "meta"


def test_second_weight_without_a_second_bias():
    torch.manual_seed(0)
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(16, dtype=torch.float64, requires_grad=True), torch.randn(16, dtype=torch.float64)
    w1 = torch.randn(16, dtype=torch.float64, requires_grad=True)
    y, y1 = layer_norm_fn(x, w, b, weight1=w1, bias1=None)
    y_ref, y1_ref = layer_norm_ref(x, w, b, weight1=w1, bias1=None)
    fp32 = dict(atol=1e-5, rtol=1e-5)  # the PyTorch path computes in fp32 whatever the input dtype
    torch.testing.assert_close(y, y_ref, **fp32)
    torch.testing.assert_close(y1, y1_ref, **fp32)
    g = torch.autograd.grad((y * 2 + y1 * 3).sum(), (x, w, w1))
    g_ref = torch.autograd.grad((y_ref * 2 + y1_ref * 3).sum(), (x, w, w1))
    for a, r in zip(g, g_ref):
        torch.testing.assert_close(a, r, **fp32)
