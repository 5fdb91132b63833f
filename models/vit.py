"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words: Transformers for Image
Recognition at Scale") with FA2's ``flash_attn.models.vit`` API: timm's ``VisionTransformer`` arguments, built
from this package's ``PatchEmbed``, ``MHA``, ``Mlp`` and pre-norm ``Block``.

A ViT layer is LayerNorm -> self-attention -> residual add -> LayerNorm -> GELU MLP -> residual add; the image
enters as patch embeddings behind a learned class token, plus learned absolute positions; the classifier reads
the class token after a final LayerNorm. The blocks here pass the residual stream separately (``Block``'s
dropout -> add -> norm order, so the add and the next norm can fuse); the model function is unchanged.

Classification only needs the class token out of the last layer, so that layer computes one query
(``mixer_subset``) against every key: its attention is a cross-attention module with ``Wq`` / ``Wkv`` in place of
``Wqkv`` (the parameter names of FA2's checkpoints). ``remap_state_dict`` turns timm checkpoint names into
these, ``remap_state_dict_hf_vit`` Hugging Face ``ViTModel`` / ``ViTForImageClassification`` ones, and
``VisionTransformer.load_state_dict`` takes timm names directly, as in FA2.
"""
import re
from collections import OrderedDict
from functools import partial

import torch
from torch import nn

from flash_attn.layers.patch_embed import PatchEmbed
from flash_attn.modules.block import Block, DropPath, _fused_add_norm
from flash_attn.modules.mha import MHA
from flash_attn.modules.mlp import FusedMLP, Mlp

# FusedMLP's activation names for the activation modules it fuses.
_FUSED_ACTIVATIONS = {(nn.GELU, "none"): "gelu", (nn.GELU, "tanh"): "gelu_approx", (nn.ReLU, None): "relu",
                      (nn.SiLU, None): "silu"}


def create_mlp_cls(embed_dim, mlp_ratio, act_layer, fused_mlp):
    """MLP constructor: dim -> Mlp(dim, int(dim * mlp_ratio)) with act_layer(), or the FusedMLP equivalent."""
    inner_dim = int(embed_dim * mlp_ratio)
    activation = act_layer()
    if not fused_mlp:
        return partial(Mlp, hidden_features=inner_dim, activation=activation)
    name = _FUSED_ACTIVATIONS.get((type(activation), getattr(activation, "approximate", None)))
    if name is None:
        raise ValueError(f"fused_mlp=True supports act_layer nn.GELU, nn.ReLU or nn.SiLU, got {act_layer!r}")
    return partial(FusedMLP, hidden_features=inner_dim, activation=name)


def create_block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate, drop_path1, drop_path2,
                 norm_layer, act_layer, use_flash_attn, fused_bias_fc, fused_mlp, fused_dropout_add_ln,
                 cross_attn=False):
    """One pre-norm ViT layer; cross_attn for a last layer that computes only a subset of its queries."""
    mixer_cls = partial(MHA, num_heads=num_heads, cross_attn=cross_attn, qkv_proj_bias=qkv_bias,
                        dropout=attn_drop_rate, fused_bias_fc=fused_bias_fc, use_flash_attn=use_flash_attn)
    mlp_cls = create_mlp_cls(embed_dim, mlp_ratio, act_layer, fused_mlp)
    # The residual stream stays fp32 under bf16/fp16 autocast, as in FA2.
    return Block(embed_dim, mixer_cls, mlp_cls, norm_cls=norm_layer, prenorm=True, resid_dropout1=drop_rate,
                 resid_dropout2=drop_rate, drop_path1=drop_path1, drop_path2=drop_path2,
                 fused_dropout_add_ln=fused_dropout_add_ln, residual_in_fp32=True)


def _refuse(name, value, supported):
    if value != supported:
        raise NotImplementedError(f"VisionTransformer({name}={value!r}) is not supported; only {supported!r}")


class VisionTransformer(nn.Module):
    """ViT image classifier: forward(x (B, in_chans, H, W)) -> logits (B, num_classes) (pre-logits (B, D) when
    num_classes == 0).

    Arguments are timm's; ``global_pool`` must be "token" with ``class_token=True``, and LayerScale
    (``init_values``), ``pre_norm``, ``fc_norm`` and other ``weight_init`` schemes are refused. drop_rate: dropout
    after the embeddings and each sublayer; attn_drop_rate: on attention probabilities; drop_path_rate: stochastic
    depth rising linearly over the layers. norm_layer default LayerNorm(eps=1e-6), act_layer default nn.GELU.
    use_flash_attn, fused_bias_fc, fused_mlp, fused_dropout_add_ln select the fused kernels.
    """

    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, global_pool="token",
                 embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0, qkv_bias=True, init_values=None,
                 class_token=True, no_embed_class=False, pre_norm=False, fc_norm=None, drop_rate=0.0,
                 attn_drop_rate=0.0, drop_path_rate=0.0, weight_init="", embed_layer=PatchEmbed, norm_layer=None,
                 act_layer=None, use_flash_attn=False, fused_bias_fc=False, fused_mlp=False,
                 fused_dropout_add_ln=False):
        super().__init__()
        _refuse("global_pool", global_pool, "token")
        _refuse("class_token", class_token, True)
        _refuse("init_values", init_values, None)
        _refuse("pre_norm", pre_norm, False)
        _refuse("fc_norm", fc_norm, None)
        _refuse("weight_init", weight_init, "")
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be a positive int, got {depth!r}")
        if not isinstance(num_classes, int) or num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0, got {num_classes!r}")
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        act_layer = act_layer or nn.GELU
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.num_features = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1
        self.no_embed_class = no_embed_class
        self.fused_dropout_add_ln = fused_dropout_add_ln

        extra = {"fused_bias_fc": fused_bias_fc} if embed_layer is PatchEmbed else {}
        self.patch_embed = embed_layer(img_size=img_size, patch_size=patch_size, in_chans=in_chans,
                                       embed_dim=embed_dim, bias=True, **extra)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        embed_len = num_patches if no_embed_class else num_patches + self.num_prefix_tokens
        self.pos_embed = nn.Parameter(torch.zeros(1, embed_len, embed_dim))

        rates = [drop_path_rate * i / (depth - 1) if depth > 1 else 0.0 for i in range(depth)]
        # Block i adds the output of layer i - 1 to the residual before its first norm, so the stochastic depth
        # of layer i - 1's MLP is block i's drop_path1 (and the last layer's is applied before the final norm).
        self.blocks = nn.ModuleList([
            create_block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate,
                         drop_path1=rates[i - 1] if i > 0 else 0.0, drop_path2=rates[i], norm_layer=norm_layer,
                         act_layer=act_layer, use_flash_attn=use_flash_attn, fused_bias_fc=fused_bias_fc,
                         fused_mlp=fused_mlp, fused_dropout_add_ln=fused_dropout_add_ln,
                         cross_attn=i == depth - 1)
            for i in range(depth)])
        self.dropout = nn.Dropout(drop_rate)
        self.drop_path = DropPath(rates[-1])
        self.norm = norm_layer(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights(weight_init)

    def init_weights(self, mode=""):
        """timm's default ViT initialisation: truncated N(0, 0.02) positions and Linear weights, zero biases,
        N(0, 1e-6) class token."""
        _refuse("weight_init", mode, "")
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    @torch.jit.ignore
    def no_weight_decay(self):
        return {"pos_embed", "cls_token"}

    def _pos_embed(self, x):
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        if self.no_embed_class:  # positions for the patches only (DeiT III): add, then prepend the class token
            return torch.cat((cls, x + self.pos_embed), dim=1)
        return torch.cat((cls, x), dim=1) + self.pos_embed

    def forward_features(self, x, all_tokens=True):
        """x (B, C, H, W) -> normalized tokens (B, 1 + num_patches, D); with all_tokens=False only the class
        token's (B, 1, D), the last layer computing that one query."""
        hidden_states = self._pos_embed(self.patch_embed(x))  # (B, 1 + N, D)
        residual = None
        for block in self.blocks[:-1]:
            hidden_states, residual = block(hidden_states, residual)
        subset = None if all_tokens else slice(0, 1)
        hidden_states, residual = self.blocks[-1](hidden_states, residual, mixer_subset=subset)
        if self.fused_dropout_add_ln:
            return _fused_add_norm(hidden_states, residual, self.norm, self.dropout, self.drop_path, False, False)
        residual = self.drop_path(self.dropout(hidden_states)) + residual
        return self.norm(residual.to(dtype=self.norm.weight.dtype))

    def forward_head(self, x, pre_logits=False):
        x = x[:, 0]  # the class token
        return x if pre_logits else self.head(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x, all_tokens=False))

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Loads this model's own state dict or a timm checkpoint's (``remap_state_dict``)."""
        state_dict = remap_state_dict(state_dict, last_layer_subset=self.blocks[-1].mixer.cross_attn)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)


# --------------------------------------------------------------------------------------------- checkpoints
def remap_state_dict(state_dict, last_layer_subset=True):
    """timm ``VisionTransformer`` state dict -> this module's (keys already in this module's form pass).

    timm's ``blocks.{i}.attn.qkv`` / ``attn.proj`` become ``mixer.Wqkv`` / ``mixer.out_proj``; with
    last_layer_subset the last layer's fused q/k/v rows [q; k; v] are split into ``Wq`` and ``Wkv``. The Conv2d
    patch weight (D, C, p1, p2) becomes the Linear weight (D, C * p1 * p2). Other names are timm's own.
    """
    out = OrderedDict()
    for key, value in state_dict.items():
        match = re.match(r"^blocks\.(\d+)\.attn\.(qkv|proj)\.(weight|bias)$", key)
        if match is not None:
            layer, name, kind = match.groups()
            key = f"blocks.{layer}.mixer.{'Wqkv' if name == 'qkv' else 'out_proj'}.{kind}"
        if key == "patch_embed.proj.weight" and value.dim() == 4:
            value = value.flatten(1)
        out[key] = value
    layers = [int(m.group(1)) for m in (re.match(r"^blocks\.(\d+)\.", k) for k in out) if m is not None]
    if last_layer_subset and layers:
        last = f"blocks.{max(layers)}.mixer."
        for kind in ("weight", "bias"):
            wqkv = out.pop(f"{last}Wqkv.{kind}", None)
            if wqkv is not None:
                if wqkv.shape[0] % 3 != 0:
                    raise ValueError(f"{last}Wqkv.{kind} has {wqkv.shape[0]} rows, not 3 * embed_dim")
                dim = wqkv.shape[0] // 3
                out[f"{last}Wq.{kind}"], out[f"{last}Wkv.{kind}"] = wqkv[:dim], wqkv[dim:]
    return out


# HF ViT layer names (checkpoint files, and transformers >= 5 module names) -> timm's; "q" / "k" / "v" are fused
# into attn.qkv.
_HF_LAYER = {
    "attention.attention.query": "q", "attention.attention.key": "k", "attention.attention.value": "v",
    "attention.q_proj": "q", "attention.k_proj": "k", "attention.v_proj": "v",
    "attention.output.dense": "attn.proj", "attention.o_proj": "attn.proj",
    "intermediate.dense": "mlp.fc1", "mlp.fc1": "mlp.fc1", "output.dense": "mlp.fc2", "mlp.fc2": "mlp.fc2",
    "layernorm_before": "norm1", "layernorm_after": "norm2",
}
_HF_TOP = {"embeddings.cls_token": "cls_token", "embeddings.position_embeddings": "pos_embed",
           "embeddings.patch_embeddings.projection.weight": "patch_embed.proj.weight",
           "embeddings.patch_embeddings.projection.bias": "patch_embed.proj.bias",
           "layernorm.weight": "norm.weight", "layernorm.bias": "norm.bias",
           "classifier.weight": "head.weight", "classifier.bias": "head.bias"}


def remap_state_dict_hf_vit(state_dict, last_layer_subset=True):
    """Hugging Face ``ViTModel`` / ``ViTForImageClassification`` state dict -> this module's.

    Takes the names of HF checkpoint files (``encoder.layer.{i}.attention.attention.query``, ...) and of
    transformers >= 5 modules (``layers.{i}.attention.q_proj``, ...). ``ViTModel``'s pooler (which
    ``ViTForImageClassification`` does not have) and the masked-image-modeling ``mask_token`` are dropped;
    other unknown keys raise KeyError. The model must be built with HF's layer_norm_eps and hidden_act.
    """
    timm = OrderedDict()
    qkv = {}
    for key, value in state_dict.items():
        key = re.sub(r"^vit\.", "", key)
        if key.startswith("pooler.") or key == "embeddings.mask_token":
            continue
        if key in _HF_TOP:
            timm[_HF_TOP[key]] = value
            continue
        match = re.match(r"^(?:encoder\.layer|layers)\.(\d+)\.(.+)\.(weight|bias)$", key)
        name = _HF_LAYER.get(match.group(2)) if match is not None else None
        if name is None:
            raise KeyError(f"unexpected key in HF ViT state dict: {key!r}")
        layer, kind = match.group(1), match.group(3)
        if name in ("q", "k", "v"):
            qkv.setdefault((layer, kind), {})[name] = value
        else:
            timm[f"blocks.{layer}.{name}.{kind}"] = value
    for (layer, kind), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise KeyError(f"layer {layer} {kind}: HF ViT state dict has {sorted(parts)} of query/key/value")
        timm[f"blocks.{layer}.attn.qkv.{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return remap_state_dict(timm, last_layer_subset=last_layer_subset)


def vit_base_patch16_224(pretrained=False, **kwargs):
    """ViT-B/16 at 224 x 224 (Dosovitskiy et al. 2021): 12 layers, width 768, 12 heads; kwargs override."""
    if pretrained:
        raise NotImplementedError("pretrained=True: no weights are downloaded; build the model and load a timm "
                                  "checkpoint with model.load_state_dict")
    return VisionTransformer(**{"patch_size": 16, "embed_dim": 768, "depth": 12, "num_heads": 12, **kwargs})
