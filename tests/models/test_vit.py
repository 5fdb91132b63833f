"""flash_attn.models.vit: a tiny random Hugging Face ViT image classifier (no downloads) converted with
remap_state_dict_hf_vit must give HF's logits and final hidden states in fp32 on CPU (both attention paths, HF's
in-memory and checkpoint-file key names); timm-named checkpoints load through load_state_dict; the class-token-only
last layer, the fused options and the refused timm arguments behave as documented."""
from collections import OrderedDict
from functools import partial

import pytest
import torch
from torch import nn
from transformers import ViTConfig, ViTForImageClassification

import flash_attn
from flash_attn.models.vit import (VisionTransformer, remap_state_dict, remap_state_dict_hf_vit,
                                   vit_base_patch16_224)

ATOL = 2e-5
IMG, PATCH, DIM, DEPTH, HEADS, CLASSES = 32, 8, 64, 2, 4, 10


@pytest.fixture(autouse=True)
def torch_ops():
    with flash_attn.use_backend("torch"):  # fused ops on their PyTorch path (the interpreter is slow)
        yield


def tiny_hf_vit(seed=0, **kwargs):
    torch.manual_seed(seed)
    config = ViTConfig(hidden_size=DIM, num_hidden_layers=DEPTH, num_attention_heads=HEADS, intermediate_size=4 * DIM,
                       image_size=IMG, patch_size=PATCH, num_channels=3, num_labels=CLASSES, layer_norm_eps=1e-6,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kwargs)
    model = ViTForImageClassification(config).eval()
    for name, p in model.named_parameters():  # non-trivial LayerNorms, biases, class token and positions
        if "layernorm" in name or name.endswith("bias") or "embeddings." in name and p.dim() == 3:
            torch.nn.init.normal_(p, mean=1.0 if "layernorm" in name and name.endswith("weight") else 0.0, std=0.1)
    return model


def tiny_vit(**kwargs):
    return VisionTransformer(img_size=IMG, patch_size=PATCH, num_classes=CLASSES, embed_dim=DIM, depth=DEPTH,
                             num_heads=HEADS, **kwargs).eval()


def images(batch=2, seed=1):
    return torch.randn(batch, 3, IMG, IMG, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("use_flash_attn", [False, True], ids=["torch", "flash"])
def test_matches_hf(use_flash_attn):
    hf = tiny_hf_vit()
    model = tiny_vit(use_flash_attn=use_flash_attn)
    model.load_state_dict(remap_state_dict_hf_vit(hf.state_dict()))
    x = images()
    with torch.no_grad():
        ref_hidden = hf.vit(x).last_hidden_state
        torch.testing.assert_close(model.forward_features(x), ref_hidden, atol=ATOL, rtol=0)
        torch.testing.assert_close(model(x), hf(x).logits, atol=ATOL, rtol=0)


def test_hf_checkpoint_file_names(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    hf = tiny_hf_vit(seed=2)
    hf.save_pretrained(tmp_path)
    state_dict = safetensors.load_file(str(tmp_path / "model.safetensors"))
    assert any(".attention.attention.query." in k for k in state_dict)  # the file's names, not the modules'
    model = tiny_vit()
    model.load_state_dict(remap_state_dict_hf_vit(state_dict))
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=ATOL, rtol=0)


def _hf_to_timm(hf_state_dict):
    """timm's names for an HF ViT checkpoint (timm's VisionTransformer: fused qkv rows [q; k; v], Conv2d patch
    projection, blocks.{i}.norm1 / attn / norm2 / mlp, final norm, head)."""
    sd = {k.removeprefix("vit."): v for k, v in hf_state_dict.items()}
    out = OrderedDict(cls_token=sd["embeddings.cls_token"], pos_embed=sd["embeddings.position_embeddings"])
    out["patch_embed.proj.weight"] = sd["embeddings.patch_embeddings.projection.weight"]
    out["patch_embed.proj.bias"] = sd["embeddings.patch_embeddings.projection.bias"]
    for i in range(DEPTH):
        src, dst = f"layers.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{dst}norm1.{kind}"] = sd[f"{src}layernorm_before.{kind}"]
            out[f"{dst}attn.qkv.{kind}"] = torch.cat([sd[f"{src}attention.{n}_proj.{kind}"] for n in "qkv"])
            out[f"{dst}attn.proj.{kind}"] = sd[f"{src}attention.o_proj.{kind}"]
            out[f"{dst}norm2.{kind}"] = sd[f"{src}layernorm_after.{kind}"]
            out[f"{dst}mlp.fc1.{kind}"] = sd[f"{src}mlp.fc1.{kind}"]
            out[f"{dst}mlp.fc2.{kind}"] = sd[f"{src}mlp.fc2.{kind}"]
    for kind in ("weight", "bias"):
        out[f"norm.{kind}"] = sd[f"layernorm.{kind}"]
        out[f"head.{kind}"] = sd[f"classifier.{kind}"]
    return out


def test_timm_checkpoint_loads_through_load_state_dict():
    hf = tiny_hf_vit(seed=3)
    timm_state_dict = _hf_to_timm(hf.state_dict())
    assert timm_state_dict["patch_embed.proj.weight"].dim() == 4
    model = tiny_vit()
    model.load_state_dict(timm_state_dict)
    assert set(model.blocks[-1].mixer.state_dict()) == {"Wq.weight", "Wq.bias", "Wkv.weight", "Wkv.bias",
                                                         "out_proj.weight", "out_proj.bias"}
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=ATOL, rtol=0)


def test_own_state_dict_round_trips_through_load_state_dict():
    torch.manual_seed(0)
    a, b = tiny_vit(), tiny_vit()
    b.load_state_dict(a.state_dict())
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name


def test_remap_state_dict_without_last_layer_subset_keeps_wqkv():
    timm_state_dict = _hf_to_timm(tiny_hf_vit().state_dict())
    remapped = remap_state_dict(timm_state_dict, last_layer_subset=False)
    assert f"blocks.{DEPTH - 1}.mixer.Wqkv.weight" in remapped and not any(".Wq." in k for k in remapped)
    assert remapped["patch_embed.proj.weight"].shape == (DIM, 3 * PATCH * PATCH)


def test_class_token_subset_equals_full_last_layer():
    torch.manual_seed(0)
    model = tiny_vit()
    x = images()
    with torch.no_grad():
        full = model.forward_features(x, all_tokens=True)
        cls_only = model.forward_features(x, all_tokens=False)
    assert full.shape == (2, 1 + (IMG // PATCH) ** 2, DIM) and cls_only.shape == (2, 1, DIM)
    torch.testing.assert_close(cls_only, full[:, :1], atol=ATOL, rtol=0)


def test_fused_mlp_and_fused_dropout_add_ln_match_unfused():
    torch.manual_seed(0)
    ref = tiny_vit()
    fused = tiny_vit(fused_mlp=True, fused_dropout_add_ln=True)
    fused.load_state_dict(ref.state_dict())
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), ref(x), atol=ATOL, rtol=0)


def test_fused_bias_fc_matches_unfused():
    pytest.importorskip("flash_attn.ops.fused_dense")
    torch.manual_seed(0)
    ref = tiny_vit()
    fused = tiny_vit(fused_bias_fc=True)
    assert type(fused.patch_embed.proj).__name__ == "FusedDense"
    assert type(fused.blocks[-1].mixer.Wkv).__name__ == "FusedDense"
    fused.load_state_dict(ref.state_dict())
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), ref(x), atol=ATOL, rtol=0)


def test_no_embed_class_positions_cover_patches_only():
    torch.manual_seed(0)
    model = tiny_vit(no_embed_class=True)
    num_patches = (IMG // PATCH) ** 2
    assert model.pos_embed.shape == (1, num_patches, DIM)
    patches = torch.randn(2, num_patches, DIM)
    tokens = model._pos_embed(patches)
    torch.testing.assert_close(tokens[:, 1:], patches + model.pos_embed, atol=0, rtol=0)
    torch.testing.assert_close(tokens[:, 0], model.cls_token[0].expand(2, -1), atol=0, rtol=0)


def test_stochastic_depth_rates_follow_the_shifted_residual():
    model = VisionTransformer(img_size=IMG, patch_size=PATCH, embed_dim=DIM, depth=3, num_heads=HEADS,
                              drop_path_rate=0.2)
    assert [b.drop_path1.p for b in model.blocks] == pytest.approx([0.0, 0.0, 0.1])
    assert [b.drop_path2.p for b in model.blocks] == pytest.approx([0.0, 0.1, 0.2])
    assert model.drop_path.p == pytest.approx(0.2)


def test_gelu_tanh_act_layer_matches_hf_gelu_new():
    hf = tiny_hf_vit(seed=4, hidden_act="gelu_pytorch_tanh")
    model = tiny_vit(act_layer=partial(nn.GELU, approximate="tanh"))
    model.load_state_dict(remap_state_dict_hf_vit(hf.state_dict()))
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=ATOL, rtol=0)


def test_vit_base_patch16_224_has_vit_b16_parameter_count():
    with torch.device("meta"):
        model = vit_base_patch16_224()
    assert sum(p.numel() for p in model.parameters()) == 86_567_656  # ViT-B/16, 1000 classes
    assert model.patch_embed.num_patches == 196 and len(model.blocks) == 12


def test_pretrained_is_refused():
    with pytest.raises(NotImplementedError, match="pretrained"):
        vit_base_patch16_224(pretrained=True)


@pytest.mark.parametrize("kwargs, name", [
    ({"global_pool": "avg"}, "global_pool"), ({"class_token": False}, "class_token"),
    ({"init_values": 1e-5}, "init_values"), ({"pre_norm": True}, "pre_norm"), ({"fc_norm": True}, "fc_norm"),
    ({"weight_init": "jax"}, "weight_init")])
def test_unsupported_timm_arguments_are_refused(kwargs, name):
    with pytest.raises(NotImplementedError, match=name):
        tiny_vit(**kwargs)


def test_fused_mlp_refuses_unknown_activation():
    with pytest.raises(ValueError, match="act_layer"):
        tiny_vit(fused_mlp=True, act_layer=nn.Tanh)


def test_hf_remap_rejects_unknown_keys():
    state_dict = dict(tiny_hf_vit().state_dict())
    state_dict["vit.layers.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="extra"):
        remap_state_dict_hf_vit(state_dict)
