"""Fused bias + activation and gated activations for MLPs, forward and backward (Triton kernels in
ops/triton/activations.py, plain PyTorch on CPU or without triton).

Functions (all accept any leading dims; the activation acts on the last one):

    bias_act(x, bias=None, activation="gelu_tanh")      act(x + bias)                        autograd
    gated_act(gate, value, activation="silu")           value * act(gate)                    autograd
    bias_gated_act(x, bias=None, activation="silu")     x + bias split into halves (value, gate),
                                                        value * act(gate) (FA2 GatedMlp order) autograd
    swiglu(x, y)                                        silu(x) * y          (FA2 name)      autograd
    geglu(x, y)                                         gelu(x) * y                           autograd
    bias_gelu_impl(x, bias), fast_gelu_impl(x)          gelu_tanh with autograd (FA2 names)
    gelu_fwd(x), gelu_bwd(g, x), bias_gelu(y, bias), bias_gelu_back(g, y, bias) -> (dy, dbias),
    relu_bwd(g, x), sqrelu_fwd(x), sqrelu_bwd(g, x)     raw forward / backward helpers (FA2 names)

activation: "gelu_tanh" (alias "gelu_approx"), "gelu" (exact, erf), "relu", "sqrelu" (relu^2, Primer),
"silu" (alias "swish"), "sigmoid" (with gating: GLU). All math runs in fp32; outputs keep the input
dtype, the bias gradient the bias dtype.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .triton import activations as _k
from .triton import use_triton

ACTIVATIONS = tuple(_k.ACT_IDS)
_ALIASES = {"gelu_approx": "gelu_tanh", "swish": "silu"}


def _canon(activation: str) -> str:
    name = _ALIASES.get(activation, activation)
    if name not in _k.ACT_IDS:
        raise ValueError(f"activation must be one of {ACTIVATIONS + tuple(_ALIASES)}, got {activation!r}")
    return name


# ------------------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("flash_attn_ops::bias_act_fwd", mutates_args=("out",))
def _bias_act_fwd_op(x: Tensor, bias: Optional[Tensor], out: Tensor, activation: str) -> None:
    _k.bias_act_fwd(x, bias, out, activation)


@_bias_act_fwd_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("flash_attn_ops::bias_act_bwd", mutates_args=("dx", "db_part"))
def _bias_act_bwd_op(dout: Tensor, x: Tensor, bias: Optional[Tensor], dx: Tensor, db_part: Optional[Tensor],
                     activation: str) -> None:
    _k.bias_act_bwd(dout, x, bias, dx, db_part, activation)


@_bias_act_bwd_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("flash_attn_ops::gated_act_fwd", mutates_args=("out",))
def _gated_fwd_op(gate: Tensor, value: Tensor, bias_g: Optional[Tensor], bias_v: Optional[Tensor], out: Tensor,
                  activation: str) -> None:
    _k.gated_fwd(gate, value, bias_g, bias_v, out, activation)


@_gated_fwd_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("flash_attn_ops::gated_act_bwd", mutates_args=("dgate", "dvalue", "dbg_part", "dbv_part"))
def _gated_bwd_op(dout: Tensor, gate: Tensor, value: Tensor, bias_g: Optional[Tensor], bias_v: Optional[Tensor],
                  dgate: Tensor, dvalue: Tensor, dbg_part: Optional[Tensor], dbv_part: Optional[Tensor],
                  activation: str) -> None:
    _k.gated_bwd(dout, gate, value, bias_g, bias_v, dgate, dvalue, dbg_part, dbv_part, activation)


@_gated_bwd_op.register_fake
def _(*args):
    return None


def _launch(op, launch):
    # The custom op is what torch.compile traces; eager calls skip its dispatcher overhead.
    return op if torch.compiler.is_compiling() else launch


# ---------------------------------------------------------------------------------------- PyTorch path
def _act_torch(x: Tensor, act: str) -> Tensor:
    if act == "gelu_tanh":
        return x * torch.sigmoid(2.0 * _k._SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
    if act == "gelu":
        return x * (0.5 + 0.5 * torch.erf(x * _k._INV_SQRT_2))
    if act == "relu":
        return x.clamp_min(0.0)
    if act == "sqrelu":
        return x.clamp_min(0.0).square()
    if act == "silu":
        return x * torch.sigmoid(x)
    return torch.sigmoid(x)


def _act_grad_torch(x: Tensor, act: str) -> Tensor:
    if act == "gelu_tanh":
        u2 = 2.0 * _k._SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        # 1 - sigmoid as sigmoid(-u): the subtraction would lose all digits of the tail (as in the kernel)
        return (torch.sigmoid(u2) + 2.0 * x * torch.sigmoid(u2) * torch.sigmoid(-u2) * _k._SQRT_2_OVER_PI
                * (1.0 + 3.0 * 0.044715 * x * x))
    if act == "gelu":
        return 0.5 + 0.5 * torch.erf(x * _k._INV_SQRT_2) + x * _k._INV_SQRT_2PI * torch.exp(-0.5 * x * x)
    if act == "relu":
        return (x > 0).to(x.dtype)
    if act == "sqrelu":
        return 2.0 * x.clamp_min(0.0)
    s, s_neg = torch.sigmoid(x), torch.sigmoid(-x)
    return s * (1.0 + x * s_neg) if act == "silu" else s * s_neg


def _pre(x: Tensor, bias: Optional[Tensor]) -> Tensor:
    return x.float() + bias.float() if bias is not None else x.float()


# ------------------------------------------------------------------------------- forward / backward
def _rows(t: Tensor) -> Tensor:
    t = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    return t if t.stride(-1) == 1 else t.contiguous()


def _bias_act_fwd(x2: Tensor, bias: Optional[Tensor], act: str) -> Tensor:
    out = torch.empty(x2.shape, device=x2.device, dtype=x2.dtype)
    if use_triton(x2):
        _launch(_bias_act_fwd_op, _k.bias_act_fwd)(x2, bias, out, act)
    else:
        out.copy_(_act_torch(_pre(x2, bias), act))
    return out


def _bias_act_bwd(dout2: Tensor, x2: Tensor, bias: Optional[Tensor], act: str) -> Tuple[Tensor, Optional[Tensor]]:
    dx = torch.empty(x2.shape, device=x2.device, dtype=x2.dtype)
    if use_triton(x2):
        M, N = x2.shape
        db_part = None
        if bias is not None:
            programs = _k.bwd_row_programs(M, N, x2.device, True)[0]
            db_part = torch.empty((programs, N), device=x2.device, dtype=torch.float32)
        _launch(_bias_act_bwd_op, _k.bias_act_bwd)(dout2, x2, bias, dx, db_part, act)
        db = db_part.sum(0) if bias is not None else None
    else:
        d = dout2.float() * _act_grad_torch(_pre(x2, bias), act)
        dx.copy_(d)
        db = d.sum(0) if bias is not None else None
    return dx, (db.to(bias.dtype) if bias is not None else None)


def _gated_fwd(g2, v2, bias_g, bias_v, act):
    out = torch.empty(g2.shape, device=g2.device, dtype=g2.dtype)
    if use_triton(g2):
        _launch(_gated_fwd_op, _k.gated_fwd)(g2, v2, bias_g, bias_v, out, act)
    else:
        out.copy_(_pre(v2, bias_v) * _act_torch(_pre(g2, bias_g), act))
    return out


def _gated_bwd(dout2, g2, v2, bias_g, bias_v, act):
    dg = torch.empty(g2.shape, device=g2.device, dtype=g2.dtype)
    dv = torch.empty(v2.shape, device=v2.device, dtype=v2.dtype)
    if use_triton(g2):
        M, N = g2.shape
        dbg_part = dbv_part = None
        if bias_g is not None:
            programs = _k.bwd_row_programs(M, N, g2.device, True)[0]
            dbg_part = torch.empty((programs, N), device=g2.device, dtype=torch.float32)
            dbv_part = torch.empty_like(dbg_part)
        _launch(_gated_bwd_op, _k.gated_bwd)(dout2, g2, v2, bias_g, bias_v, dg, dv, dbg_part, dbv_part, act)
        dbg = dbg_part.sum(0) if bias_g is not None else None
        dbv = dbv_part.sum(0) if bias_g is not None else None
    else:
        pg, pv, d = _pre(g2, bias_g), _pre(v2, bias_v), dout2.float()
        dvf = d * _act_torch(pg, act)
        dgf = d * pv * _act_grad_torch(pg, act)
        dg.copy_(dgf)
        dv.copy_(dvf)
        dbg = dgf.sum(0) if bias_g is not None else None
        dbv = dvf.sum(0) if bias_g is not None else None
    if bias_g is not None:
        dbg, dbv = dbg.to(bias_g.dtype), dbv.to(bias_v.dtype)
    return dg, dv, dbg, dbv


def _check_bias(name: str, bias: Optional[Tensor], n: int, x: Tensor):
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{name} must have shape ({n},) (the last dim of the input), got {tuple(bias.shape)}")
    if bias is not None and bias.device != x.device:
        raise ValueError(f"{name} must be on the input's device {x.device}, got {bias.device}")


def _check_input(name: str, x):
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise TypeError(f"{name} must be a floating-point tensor with at least one dim")


class BiasActFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, activation):
        x2 = _rows(x)
        out = _bias_act_fwd(x2, bias, activation)
        ctx.save_for_backward(x2, bias)
        ctx.activation, ctx.shape = activation, x.shape
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, dout):
        x2, bias = ctx.saved_tensors
        dx, db = _bias_act_bwd(_rows(dout), x2, bias, ctx.activation)
        return dx.view(ctx.shape), db, None


class GatedActFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, value, bias_g, bias_v, activation):
        g2, v2 = _rows(gate), _rows(value)
        out = _gated_fwd(g2, v2, bias_g, bias_v, activation)
        ctx.save_for_backward(g2, v2, bias_g, bias_v)
        ctx.activation, ctx.shape = activation, gate.shape
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, dout):
        g2, v2, bias_g, bias_v = ctx.saved_tensors
        dg, dv, dbg, dbv = _gated_bwd(_rows(dout), g2, v2, bias_g, bias_v, ctx.activation)
        return dg.view(ctx.shape), dv.view(ctx.shape), dbg, dbv, None


def bias_act(x: Tensor, bias: Optional[Tensor] = None, activation: str = "gelu_tanh") -> Tensor:
    """act(x + bias). x: (..., N) float; bias: (N,) or None. Returns x's shape and dtype."""
    _check_input("x", x)
    act = _canon(activation)
    _check_bias("bias", bias, x.shape[-1], x)
    return BiasActFn.apply(x, bias, act)


def gated_act(gate: Tensor, value: Tensor, activation: str = "silu", bias_gate: Optional[Tensor] = None,
              bias_value: Optional[Tensor] = None) -> Tensor:
    """(value + bias_value) * act(gate + bias_gate). gate, value: (..., N) of one shape and dtype;
    biases (N,), both or neither."""
    _check_input("gate", gate)
    _check_input("value", value)
    act = _canon(activation)
    if gate.shape != value.shape or gate.dtype != value.dtype or gate.device != value.device:
        raise ValueError(f"gate and value must match in shape, dtype and device, got {tuple(gate.shape)} "
                         f"{gate.dtype} {gate.device} and {tuple(value.shape)} {value.dtype} {value.device}")
    if (bias_gate is None) != (bias_value is None):
        raise ValueError("bias_gate and bias_value must be given together")
    _check_bias("bias_gate", bias_gate, gate.shape[-1], gate)
    _check_bias("bias_value", bias_value, gate.shape[-1], gate)
    return GatedActFn.apply(gate, value, bias_gate, bias_value, act)


def bias_gated_act(x: Tensor, bias: Optional[Tensor] = None, activation: str = "silu") -> Tensor:
    """GLU-family activation of a fused up-projection: y = x + bias is split into halves (value, gate)
    along the last dim and value * act(gate) returned. x: (..., 2N); bias: (2N,). Returns (..., N)."""
    _check_input("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"x's last dim must be even (value and gate halves), got {x.shape[-1]}")
    _check_bias("bias", bias, x.shape[-1], x)
    value, gate = x.chunk(2, dim=-1)
    bv, bg = bias.chunk(2) if bias is not None else (None, None)
    return gated_act(gate, value, activation, bg, bv)


def swiglu(x: Tensor, y: Tensor) -> Tensor:
    """silu(x) * y (FA2's swiglu)."""
    return gated_act(x, y, "silu")


def geglu(x: Tensor, y: Tensor) -> Tensor:
    """gelu(x) * y with the exact (erf) GELU."""
    return gated_act(x, y, "gelu")


# ------------------------------------------------------------------------------ FA2-compatible names
def bias_gelu_impl(input: Tensor, bias: Tensor) -> Tensor:
    """gelu_tanh(input + bias) with autograd."""
    return bias_act(input, bias, "gelu_tanh")


def fast_gelu_impl(input: Tensor) -> Tensor:
    """gelu_tanh(input) with autograd."""
    return bias_act(input, None, "gelu_tanh")


def _raw_fwd(x, bias, act):
    return _bias_act_fwd(_rows(x), bias, act).view(x.shape)


def _raw_bwd(g, x, bias, act):
    dx, db = _bias_act_bwd(_rows(g), _rows(x), bias, act)
    return dx.view(x.shape), db


def gelu_fwd(x: Tensor) -> Tensor:
    return _raw_fwd(x, None, "gelu_tanh")


def gelu_bwd(g: Tensor, x: Tensor) -> Tensor:
    return _raw_bwd(g, x, None, "gelu_tanh")[0]


def bias_gelu(y: Tensor, bias: Tensor) -> Tensor:
    return _raw_fwd(y, bias, "gelu_tanh")


def bias_gelu_back(g: Tensor, y: Tensor, bias: Tensor) -> Tuple[Tensor, Tensor]:
    """(dL/dy, dL/dbias) of gelu_tanh(y + bias); dbias sums over all leading dims."""
    return _raw_bwd(g, y, bias, "gelu_tanh")


def relu_bwd(g: Tensor, x: Tensor) -> Tensor:
    return _raw_bwd(g, x, None, "relu")[0]


def sqrelu_fwd(x: Tensor) -> Tensor:
    return _raw_fwd(x, None, "sqrelu")


def sqrelu_bwd(g: Tensor, x: Tensor) -> Tensor:
    return _raw_bwd(g, x, None, "sqrelu")[0]
