"""Feed-forward blocks: ``Mlp`` (fc1 -> activation -> fc2), ``GatedMlp`` (GLU family, Shazeer 2020,
"GLU Variants Improve Transformer") and ``FusedMLP`` (fc1 with the bias add and activation fused).

Parameter names (``fc1``, ``fc2``) match FlashAttention 2's ``flash_attn.modules.mlp``; in ``GatedMlp`` the
first half of fc1's output is the value and the second half the gate, as in FA2 checkpoints.
"""
import torch
import torch.nn.functional as F
from torch import nn


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
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias1, **factory_kwargs)
        self.activation = activation
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory_kwargs)

    def forward(self, x):
        y = self.fc2(self.activation(self.fc1(x)))
        return y if not self.return_residual else (y, x)


def _silu_mul(gate, y):
    try:
        from flash_attn.ops.activations import swiglu
    except ImportError:
        return F.silu(gate) * y
    return swiglu(gate, y)


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
        self.fc1 = nn.Linear(in_features, 2 * hidden_features, bias=bias1, **factory_kwargs)
        self.activation = activation
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias2, **factory_kwargs)

    def forward(self, x):
        y = self.fc1(x)
        if self.activation is F.sigmoid:
            y = F.glu(y, dim=-1)
        else:
            y, gate = y.chunk(2, dim=-1)
            # SwiGLU goes through the fused elementwise op: one read of (y, gate) instead of three passes.
            y = _silu_mul(gate, y) if self.activation is F.silu else y * self.activation(gate)
        y = self.fc2(y)
        return y if not self.return_residual else (y, x)
