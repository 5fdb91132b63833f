"""Feed-forward blocks: ``Mlp`` (fc1 -> activation -> fc2), ``GatedMlp`` (GLU family, Shazeer 2020,
"GLU Variants Improve Transformer"), and, as in FA2, ``FusedMLP`` / ``ParallelFusedMLP`` from
``flash_attn.ops.fused_dense`` (FA2's fused MLP: its activation one kernel, checkpoint levels, tensor parallelism).

Parameter names (``fc1``, ``fc2``) match FlashAttention 2's ``flash_attn.modules.mlp``; in ``GatedMlp`` the
first half of fc1's output is the value and the second half the gate, as in FA2 checkpoints. fc1 and fc2 are
``flash_attn.ops.linear.Linear``: on CUDA (or with FLASH_ATTN_FP32_WGRAD=1) fp32 weight/bias gradients
straight from the GEMM and a column-sum kernel under autocast, else nn.Linear (see that module).
"""
import torch
import torch.nn.functional as F
from torch import nn

from flash_attn.ops.activations import gated_act
from flash_attn.ops.fused_dense import FusedMLP, ParallelFusedMLP  # noqa: F401  (FA2 exports them here too)
from flash_attn.ops.linear import Linear


class Mlp(nn.Module):
    """x (..., in_features) -> fc2(activation(fc1(x))) (..., out_features).

    hidden_features defaults to 4 * in_features, out_features to in_features. With return_residual the
    forward returns (out, x) so a following fused dropout-add-norm can take the residual.
    """

    def __init__(self, in_features, hidden_features=None, out_features=None, activation=F.gelu, bias1=True,
                 bias2=True, return_residual=False, device=None, dtype=None):
        super().__init__()
        factory_kwargs = {"device": device, "dtype": dtype}
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        if not callable(activation):
            raise TypeError(f"activation must be callable, got {type(activation).__name__}")
        self.return_residual = return_residual
        self.fc1 = Linear(in_features, hidden_features, bias=bias1, **factory_kwargs)
        self.activation = activation
        self.fc2 = Linear(hidden_features, out_features, bias=bias2, **factory_kwargs)

    def forward(self, x):
        y = self.fc2(self.activation(self.fc1(x)))
        return y if not self.return_residual else (y, x)


# GatedMlp activations that the fused gating kernel implements (value * act(gate) in one pass).
_GATED_KERNEL_NAMES = {F.sigmoid: "sigmoid", torch.sigmoid: "sigmoid", F.silu: "silu", F.gelu: "gelu"}


class GatedMlp(nn.Module):
    """x (..., in_features) -> fc2(value * activation(gate)) (..., out_features), [value, gate] = fc1(x).

    hidden_features defaults to 8/3 * in_features (same parameter count as a 4x Mlp), rounded up to a
    multiple of ``multiple_of``. activation=F.sigmoid is GLU, F.silu SwiGLU, F.gelu GeGLU.
    """

    def __init__(self, in_features, hidden_features=None, out_features=None, activation=F.sigmoid, bias1=True,
                 bias2=True, multiple_of=128, return_residual=False, device=None, dtype=None):
        super().__init__()
        factory_kwargs = {"device": device, "dtype": dtype}
        if not callable(activation):
            raise TypeError(f"activation must be callable, got {type(activation).__name__}")
        if not isinstance(multiple_of, int) or multiple_of < 1:
            raise ValueError(f"multiple_of must be a positive int, got {multiple_of!r}")
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else int(8 * in_features / 3)
        hidden_features = (hidden_features + multiple_of - 1) // multiple_of * multiple_of
        self.return_residual = return_residual
        self.fc1 = Linear(in_features, 2 * hidden_features, bias=bias1, **factory_kwargs)
        self.activation = activation
        self.fc2 = Linear(hidden_features, out_features, bias=bias2, **factory_kwargs)

    def forward(self, x):
        y, gate = self.fc1(x).chunk(2, dim=-1)
        name = _GATED_KERNEL_NAMES.get(self.activation)
        # GLU / SwiGLU / GeGLU run as one fused elementwise kernel instead of an activation, then a product.
        y = gated_act(gate, y, name) if name is not None else y * self.activation(gate)
        y = self.fc2(y)
        return y if not self.return_residual else (y, x)
