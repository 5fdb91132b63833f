"""Patch embedding of the Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words",
section 3.1), API of FA2's ``flash_attn.layers.patch_embed`` (timm's ``PatchEmbed`` arguments).

The image is cut into non-overlapping patches and each flattened patch goes through one linear layer. That
is the same map as timm's stride-``patch_size`` Conv2d, computed as a GEMM over (channel, row, column)-ordered
patch vectors: a Conv2d weight (D, C, p1, p2) is the Linear weight (D, C * p1 * p2) reshaped, and
:meth:`PatchEmbed._load_from_state_dict` accepts either form, so timm checkpoints load as they are.
"""
from torch import nn

from flash_attn.ops.linear import Linear


def _pair(value, name):
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(pair) != 2 or not all(isinstance(v, int) and v > 0 for v in pair):
        raise ValueError(f"{name} must be a positive int or a pair of them, got {value!r}")
    return pair


def _fused_dense_cls():
    try:
        from flash_attn.ops.fused_dense import FusedDense
    except ImportError as e:
        raise NotImplementedError(f"fused_bias_fc=True needs flash_attn.ops.fused_dense.FusedDense, which is not "
                                  f"importable here ({e}); use fused_bias_fc=False") from e
    return FusedDense


class PatchEmbed(nn.Module):
    """Image (B, C, H, W) -> patch embeddings (B, H/p1 * W/p2, D), or (B, H/p1, W/p2, D) with flatten=False.

    Args:
        img_size: H, W the module accepts (int or pair); each must be a multiple of the patch size.
        patch_size: p1, p2 (int or pair). in_chans: C. embed_dim: D.
        norm_layer: constructor taking D, applied to the embeddings (default none).
        flatten: merge the patch grid into one sequence dim.
        bias: bias of the projection.
        fused_bias_fc: project with ``flash_attn.ops.fused_dense.FusedDense`` (only with bias=True, as in FA2);
            NotImplementedError when that module is not importable.
    """

    def __init__(self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, norm_layer=None, flatten=True,
                 bias=True, fused_bias_fc=False):
        super().__init__()
        img_size = _pair(img_size, "img_size")
        patch_size = _pair(patch_size, "patch_size")
        if img_size[0] % patch_size[0] or img_size[1] % patch_size[1]:
            raise ValueError(f"img_size {img_size} must be a multiple of patch_size {patch_size}")
        if not isinstance(in_chans, int) or in_chans < 1 or not isinstance(embed_dim, int) or embed_dim < 1:
            raise ValueError(f"in_chans and embed_dim must be positive ints, got {in_chans!r} and {embed_dim!r}")
        self.img_size = img_size
        self.in_chans = in_chans
        self.patch_size = patch_size
        self.grid_size = (img_size[0] // patch_size[0], img_size[1] // patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.flatten = flatten
        linear_cls = _fused_dense_cls() if fused_bias_fc and bias else Linear
        self.proj = linear_cls(in_chans * patch_size[0] * patch_size[1], embed_dim, bias=bias)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        weight = state_dict.get(prefix + "proj.weight")
        if weight is not None and weight.dim() == 4:  # a Conv2d checkpoint (timm): (D, C, p1, p2)
            state_dict[prefix + "proj.weight"] = weight.flatten(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x):
        if x.dim() != 4:
            raise ValueError(f"x must be an image batch (B, C, H, W), got shape {tuple(x.shape)}")
        batch, chans, height, width = x.shape
        if chans != self.in_chans:
            raise ValueError(f"x has {chans} channels, the module was built for in_chans={self.in_chans}")
        if (height, width) != self.img_size:
            raise ValueError(f"x has image size ({height}, {width}), the module was built for img_size "
                             f"{self.img_size}")
        (p1, p2), (gh, gw) = self.patch_size, self.grid_size
        patches = x.reshape(batch, chans, gh, p1, gw, p2).permute(0, 2, 4, 1, 3, 5)  # (B, gh, gw, C, p1, p2)
        out = self.proj(patches.reshape(batch, gh, gw, chans * p1 * p2))  # (B, gh, gw, D)
        if self.flatten:
            out = out.flatten(1, 2)  # (B, gh * gw, D)
        return self.norm(out)
