"""Feed-forward blocks: ``Mlp`` (fc1 -> activation -> fc2), ``GatedMlp`` (GLU family, Shazeer 2020,
"GLU Variants Improve Transformer") and ``FusedMLP`` (fc1's bias add and the activation in one kernel).

Parameter names (``fc1``, ``fc2``) match FlashAttention 2's ``flash_attn.modules.mlp``; in ``GatedMlp`` the
first half of fc1's output is the value and the second half the gate, as in FA2 checkpoints. fc1 and fc2 are
``flash_attn.ops.linear.Linear``: on CUDA (or with FLASH_ATTN_FP32_WGRAD=1) fp32 weight/bias gradients
straight from the GEMM and a column-sum kernel under autocast, else nn.Linear (see that module).
"""
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from flash_attn.ops.activations import ACTIVATIONS, bias_act, gated_act
from flash_attn.ops.linear import Linear, linear


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


def _fc1_act(x, weight, bias, activation):
    return bias_act(linear(x, weight), bias, activation)


class FusedMLP(nn.Module):
    """x (..., in_features) -> fc2(act(x @ fc1.weight^T + fc1.bias)), with the bias add and activation of fc1
    in one kernel (flash_attn.ops.activations.bias_act) after a bias-free GEMM.

    activation: "gelu_approx" (tanh GELU), "relu", "sqrelu", or any other bias_act name ("gelu", "silu").
    checkpoint_lvl trades compute for memory in the backward pass: 0 keeps fc1's output and the activation,
    1 recomputes the activation, 2 recomputes fc1 too (only x is kept).
    heuristic: accepted for FA2 signature compatibility (it picked a cuBLASLt epilogue); it has no effect.
    """

    def __init__(self, in_features, hidden_features=None, out_features=None, bias1=True, bias2=True,
                 activation="gelu_approx", return_residual=False, checkpoint_lvl=0, heuristic="auto",
                 device=None, dtype=None):
        super().__init__()
        factory_kwargs = {"device": device, "dtype": dtype}
        if activation not in ACTIVATIONS + ("gelu_approx",) or activation == "sigmoid":
            raise ValueError(f"activation must be one of {sorted(set(ACTIVATIONS + ('gelu_approx',)) - {'sigmoid'})}, "
                             f"got {activation!r}")
        if checkpoint_lvl not in (0, 1, 2):
            raise ValueError(f"checkpoint_lvl must be 0, 1 or 2, got {checkpoint_lvl!r}")
        out_features = out_features if out_features is not None else in_features
        hidden_features = hidden_features if hidden_features is not None else in_features * 4
        self.activation = activation
        self.return_residual = return_residual
        self.checkpoint_lvl = checkpoint_lvl
        self.heuristic = heuristic
        self.fc1 = Linear(in_features, hidden_features, bias=bias1, **factory_kwargs)
        self.fc2 = Linear(hidden_features, out_features, bias=bias2, **factory_kwargs)

    def forward(self, x):
        weight, bias = self.fc1.weight, self.fc1.bias
        if self.checkpoint_lvl == 0 or not torch.is_grad_enabled():
            h = _fc1_act(x, weight, bias, self.activation)
        elif self.checkpoint_lvl == 1:
            pre = linear(x, weight)
            h = checkpoint(bias_act, pre, bias, self.activation, use_reentrant=False)
        else:
            h = checkpoint(_fc1_act, x, weight, bias, self.activation, use_reentrant=False)
        y = self.fc2(h)
        return y if not self.return_residual else (y, x)
