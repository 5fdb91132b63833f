"""flash_attn.layers.patch_embed.PatchEmbed against timm's formulation, a stride-patch_size Conv2d: same output
for square and non-square images and patches, Conv2d checkpoints load, arguments are checked, and fused_bias_fc
takes flash_attn.ops.fused_dense.FusedDense when it imports and refuses clearly when it does not."""
import sys
import types

import pytest
import torch
from torch import nn

from flash_attn.layers.patch_embed import PatchEmbed
from flash_attn.ops.linear import Linear


def conv_reference(embed, images):
    """timm's PatchEmbed: Conv2d(kernel = stride = patch_size), then (B, D, gh, gw) -> (B, gh * gw, D)."""
    p1, p2 = embed.patch_size
    weight = embed.proj.weight.reshape(embed.proj.out_features, -1, p1, p2)
    return nn.functional.conv2d(images, weight, embed.proj.bias, stride=(p1, p2))


@pytest.mark.parametrize("img_size, patch_size", [(32, 8), ((16, 24), (4, 8))], ids=["square", "rectangular"])
def test_matches_conv2d(img_size, patch_size):
    torch.manual_seed(0)
    embed = PatchEmbed(img_size=img_size, patch_size=patch_size, in_chans=3, embed_dim=20)
    nn.init.normal_(embed.proj.bias)
    h, w = embed.img_size
    images = torch.randn(2, 3, h, w)
    ref = conv_reference(embed, images)  # (B, D, gh, gw)
    assert embed.grid_size == ref.shape[2:] and embed.num_patches == ref.shape[2] * ref.shape[3]
    torch.testing.assert_close(embed(images), ref.flatten(2).transpose(1, 2), atol=1e-5, rtol=0)


def test_flatten_false_keeps_the_grid():
    torch.manual_seed(0)
    embed = PatchEmbed(img_size=(16, 24), patch_size=(4, 8), in_chans=2, embed_dim=12, flatten=False)
    images = torch.randn(3, 2, 16, 24)
    out = embed(images)
    assert out.shape == (3, 4, 3, 12)
    torch.testing.assert_close(out, conv_reference(embed, images).permute(0, 2, 3, 1), atol=1e-5, rtol=0)


def test_conv2d_checkpoint_loads():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, kernel_size=4, stride=4)
    embed = PatchEmbed(img_size=16, patch_size=4, in_chans=3, embed_dim=16)
    embed.load_state_dict({"proj.weight": conv.weight.detach().clone(), "proj.bias": conv.bias.detach().clone()})
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(embed(images), conv(images).flatten(2).transpose(1, 2), atol=1e-5, rtol=0)


def test_norm_layer_and_no_bias():
    embed = PatchEmbed(img_size=8, patch_size=4, in_chans=1, embed_dim=6, norm_layer=nn.LayerNorm, bias=False)
    assert embed.proj.bias is None and isinstance(embed.norm, nn.LayerNorm)
    out = embed(torch.randn(2, 1, 8, 8))
    torch.testing.assert_close(out.mean(-1), torch.zeros(2, 4), atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape, match", [((2, 3, 32, 16), "img_size"), ((2, 1, 32, 32), "in_chans"),
                                          ((3, 32, 32), "B, C, H, W")])
def test_bad_input_raises(shape, match):
    embed = PatchEmbed(img_size=32, patch_size=8, in_chans=3, embed_dim=8)
    with pytest.raises(ValueError, match=match):
        embed(torch.randn(*shape))


@pytest.mark.parametrize("kwargs, match", [({"img_size": 30, "patch_size": 8}, "multiple"),
                                           ({"patch_size": 0}, "patch_size"), ({"img_size": (32, 32, 3)}, "img_size"),
                                           ({"embed_dim": 0}, "embed_dim")])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PatchEmbed(**{"img_size": 32, "patch_size": 8, "in_chans": 3, "embed_dim": 8, **kwargs})


def test_fused_bias_fc_refused_without_fused_dense(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.ops.fused_dense", None)  # makes the import fail
    with pytest.raises(NotImplementedError, match="fused_bias_fc"):
        PatchEmbed(img_size=16, patch_size=4, embed_dim=8, fused_bias_fc=True)
    # without a bias there is nothing to fuse: FA2 builds the plain linear layer
    assert type(PatchEmbed(img_size=16, patch_size=4, embed_dim=8, bias=False, fused_bias_fc=True).proj) is Linear


def test_fused_bias_fc_uses_fused_dense(monkeypatch):
    class FusedDense(nn.Linear):
        pass

    monkeypatch.setitem(sys.modules, "flash_attn.ops.fused_dense", types.SimpleNamespace(FusedDense=FusedDense))
    embed = PatchEmbed(img_size=16, patch_size=4, in_chans=3, embed_dim=8, fused_bias_fc=True)
    assert type(embed.proj) is FusedDense and embed.proj.in_features == 48 and embed.proj.bias is not None


def test_fused_bias_fc_matches_unfused():
    fused_dense = pytest.importorskip("flash_attn.ops.fused_dense")
    torch.manual_seed(0)
    ref = PatchEmbed(img_size=16, patch_size=4, in_chans=3, embed_dim=8)
    nn.init.normal_(ref.proj.bias)
    fused = PatchEmbed(img_size=16, patch_size=4, in_chans=3, embed_dim=8, fused_bias_fc=True)
    assert isinstance(fused.proj, fused_dense.FusedDense)
    fused.load_state_dict(ref.state_dict())
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(fused(images), ref(images), atol=1e-6, rtol=0)
