"""MHA(fused_bias_fc=True) builds its projections as flash_attn.ops.fused_dense.FusedDense (FA2's layers) with the
same parameters as the default Linear layers: a state dict moves between the two and gives the same outputs and
gradients, return_residual included; GPT / fused-MLP configs are wired through them."""
import pytest
import torch
import torch.nn.functional as F

import flash_attn
from flash_attn.modules.mha import MHA
from flash_attn.ops.fused_dense import FusedDense, FusedMLP

D, H = 64, 4


@pytest.fixture(autouse=True)
def torch_ops():
    with flash_attn.use_backend("torch"):
        yield


def pair(**kwargs):
    torch.manual_seed(0)
    plain = MHA(D, H, **kwargs)
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.2)
    fused = MHA(D, H, fused_bias_fc=True, **kwargs)
    fused.load_state_dict(plain.state_dict())
    return plain.eval(), fused.eval()


def projections(m):
    names = ["Wq", "Wkv"] if m.cross_attn else ["Wqkv"]
    return [getattr(m, n) for n in names + ["out_proj"]]


@pytest.mark.parametrize("kwargs", [dict(), dict(num_heads_kv=2, causal=True), dict(cross_attn=True),
                                    dict(qkv_proj_bias=False, out_proj_bias=False, use_flash_attn=True)],
                         ids=["mha", "gqa-causal", "cross", "no-bias-flash"])
def test_fused_bias_fc_matches_plain(kwargs):
    plain, fused = pair(**kwargs)
    assert all(type(m) is FusedDense for m in projections(fused))
    assert not any(isinstance(m, FusedDense) for m in projections(plain))
    assert list(fused.state_dict()) == list(plain.state_dict())
    x = torch.randn(2, 7, D, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    extra = dict(x_kv=torch.randn(2, 5, D)) if kwargs.get("cross_attn") else {}
    out, out_ref = fused(x, **extra), plain(x2, **extra)
    torch.testing.assert_close(out, out_ref, atol=0, rtol=0)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, atol=0, rtol=0)
    for (name, a), b in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("cross_attn", [False, True])
def test_return_residual_through_fused_dense(cross_attn):
    plain, fused = pair(return_residual=True, cross_attn=cross_attn)
    first = fused.Wq if cross_attn else fused.Wqkv
    assert first.return_residual and not fused.out_proj.return_residual
    x = torch.randn(2, 6, D, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, residual = fused(x)
    out_ref, residual_ref = plain(x2)
    assert residual is x and residual_ref is x2
    torch.testing.assert_close(out, out_ref, atol=0, rtol=0)
    (out + F.gelu(residual)).sum().backward()
    (out_ref + F.gelu(residual_ref)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=0, rtol=0)


def test_return_residual_with_mixer_subset():
    _, fused = pair(return_residual=True, cross_attn=True)
    x = torch.randn(2, 6, D)
    out, residual = fused(x, mixer_subset=slice(0, 2))
    assert out.shape == (2, 2, D)
    torch.testing.assert_close(residual, x[:, :2], atol=0, rtol=0)


def test_fused_bias_fc_under_cpu_autocast():
    plain, fused = pair()
    x = torch.randn(2, 5, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_ref = fused(x), plain(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, out_ref, atol=0, rtol=0)


def _gpt_pair(**kw):
    from transformers import GPT2Config

    from flash_attn.models.gpt import GPTLMHeadModel

    def build(fused):
        config = GPT2Config(n_embd=D, n_head=H, n_layer=2, vocab_size=97, n_positions=32, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new", fused_bias_fc=fused,
                            fused_mlp=fused, **kw)
        torch.manual_seed(0)
        return GPTLMHeadModel(config).eval()

    plain, fused = build(False), build(True)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


def test_gpt_config_flags_build_fused_layers():
    plain, fused = _gpt_pair()
    layer = fused.transformer.layers[0]
    assert type(layer.mixer.Wqkv) is FusedDense and type(layer.mixer.out_proj) is FusedDense
    assert type(layer.mlp) is FusedMLP
    assert type(plain.transformer.layers[0].mlp) is not FusedMLP
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(fused(ids).logits, plain(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_fused_bias_fc_bf16():
    torch.manual_seed(0)
    plain = MHA(1024, 16, use_flash_attn=True, causal=True, device="cuda", dtype=torch.bfloat16)
    fused = MHA(1024, 16, use_flash_attn=True, causal=True, fused_bias_fc=True, return_residual=True, device="cuda",
                dtype=torch.bfloat16)
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, residual = fused(x)
    assert residual is x
    out_ref = plain(x2)
    torch.testing.assert_close(out, out_ref, atol=0, rtol=0)
    out.float().sum().backward()
    out_ref.float().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=0, rtol=0)
