"""BTLM (Cerebras, Dey et al. 2023, "BTLM-3B-8K: 7B Parameter Performance in a 3B Parameter Model") as a
``GPTLMHeadModel``: config conversion and checkpoint remapping.

BTLM is remote code on the Hugging Face Hub (``trust_remote_code``), not a transformers class. Its layer is a
GPT-2 layer (pre-norm LayerNorm, biased projections stored as GPT-2's Conv1D, i.e. weights (in, out), transposed
here) with three changes:

* a SwiGLU MLP (``activation_function="swiglu"``): ``c_proj(c_fc(x) * silu(c_fc2(x)))``, so ``mlp.fc1`` is
  [c_fc; c_fc2] (GatedMlp's value, then gate);
* ALiBi (Press et al. 2022) instead of learned positions (``position_embedding_type="alibi"``), with the paper's
  slopes, which the checkpoint stores as ``transformer.relative_pe.slopes`` (checked, then dropped);
* muP (Yang et al. 2022, "Tensor Programs V"): the embeddings are multiplied by ``mup_embeddings_scale``, the
  logits by ``mup_output_alpha * mup_width_scale``, and with ``mup_scale_qk_dot_by_d`` attention scores are
  divided by head_dim instead of sqrt(head_dim). :mod:`flash_attn.models.gpt` reads these as
  ``mup_embeddings_multiplier``, ``mup_output_multiplier`` / ``mup_width_scale`` and ``mup_scale_qk_dot_by_d``.

The LM head is tied to the word embedding by default and has no bias. ALiBi position interpolation
(``alibi_scaling``) is refused with NotImplementedError.

Training from scratch with muP's rules (BTLM's width-transfer recipe; ``w = mup_width_scale = d_base / d``):

* :func:`mup_init_` initialises as BTLM's reference code: embeddings N(0, initializer_range); every hidden matrix
  (Wqkv, fc1) N(0, initializer_range * sqrt(w)), i.e. variance sigma^2 * d_base / d (fan-in scaling); the
  projections that write into the residual stream (out_proj, fc2) that std / sqrt(2 * n_layer); biases 0;
  LayerNorm weight 1, bias 0. ``GPTLMHeadModel`` / ``GPTModel`` call it themselves when the config's
  ``mup_width_scale`` is not 1.
* :func:`mup_param_groups` gives AdamW groups with muP's Adam learning rates: hidden matrices ``lr * w``
  (Cerebras' ``adjust_learning_rate.decoder_kernel``, which BTLM's checkpoint converter maps to
  ``mup_width_scale``), embeddings (and an untied LM head), biases and norms ``lr``; weight decay on the matrices
  and embeddings, none on biases and norms. ``flash-attn train`` with ``model.arch=btlm`` uses both.

Example::

    model = GPTLMHeadModel(btlm_config_to_gpt2_config(btlm_config))  # muP-initialised
    optimizer = torch.optim.AdamW(mup_param_groups(model, lr=6e-3, weight_decay=0.1), betas=(0.9, 0.95))
"""
import math
from collections import OrderedDict

import torch
from torch import nn
from transformers import GPT2Config

from flash_attn.models.gpt import _inv_remap_embeddings_and_head, _move_params, _remap_embeddings_and_head
from flash_attn.modules.mha import get_alibi_slopes


def _field(c, name, alias):
    """BTLMConfig keeps GPT-2's names (n_embd, ...) and maps hidden_size & co. onto them; plain objects may have
    either."""
    value = getattr(c, name, None)
    return getattr(c, alias) if value is None else value


def btlm_config_to_gpt2_config(btlm_config):
    """BTLM config -> GPT2Config for GPTLMHeadModel (ALiBi or learned positions, SwiGLU or GPT-2 MLP, muP)."""
    c = btlm_config
    hidden, heads = _field(c, "n_embd", "hidden_size"), _field(c, "n_head", "num_attention_heads")
    if hidden % heads != 0:
        raise ValueError(f"n_embd ({hidden}) must be divisible by n_head ({heads})")
    position = getattr(c, "position_embedding_type", "learned")
    if position not in ("alibi", "learned"):
        raise NotImplementedError(f"position_embedding_type {position!r}: supported are 'alibi' and 'learned'")
    if getattr(c, "alibi_scaling", None) is not None:
        raise NotImplementedError(f"alibi_scaling={c.alibi_scaling!r} (ALiBi position interpolation) is not "
                                  "supported; only alibi_scaling=None converts")
    if getattr(c, "add_cross_attention", False):
        raise NotImplementedError("BTLM with add_cross_attention=True is not supported")
    alibi = position == "alibi"
    return GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=0 if alibi else _field(c, "n_positions", "max_position_embeddings"),
        n_embd=hidden,
        n_layer=_field(c, "n_layer", "num_hidden_layers"),
        n_head=heads,
        n_inner=getattr(c, "n_inner", None) or 4 * hidden,
        activation_function=c.activation_function,
        resid_pdrop=c.resid_pdrop,
        embd_pdrop=c.embd_pdrop,
        attn_pdrop=c.attn_pdrop,
        layer_norm_epsilon=c.layer_norm_epsilon,
        initializer_range=getattr(c, "initializer_range", 0.02),
        scale_attn_weights=getattr(c, "scale_attn_weights", True),
        scale_attn_by_inverse_layer_idx=getattr(c, "scale_attn_by_inverse_layer_idx", False),
        bos_token_id=getattr(c, "bos_token_id", None),
        eos_token_id=getattr(c, "eos_token_id", None),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        # The fields below are read by flash_attn.models.gpt.
        use_alibi=alibi,
        mup_width_scale=getattr(c, "mup_width_scale", 1.0),
        mup_embeddings_multiplier=getattr(c, "mup_embeddings_scale", 1.0),
        mup_output_multiplier=getattr(c, "mup_output_alpha", 1.0),
        mup_scale_qk_dot_by_d=bool(getattr(c, "mup_scale_qk_dot_by_d", False)),
        mlp_multiple_of=1,  # n_inner is exact (6826 in BTLM-3B-8K)
    )


# Conv1D projections (weights (in, out), transposed) and LayerNorms: BTLM name inside transformer.h.{i} -> ours
_CONV1D = {"attn.c_attn": "mixer.Wqkv", "attn.c_proj": "mixer.out_proj", "mlp.c_proj": "mlp.fc2"}
_NORMS = {"ln_1": "norm1", "ln_2": "norm2"}


def _check_slopes(slopes, n_head):
    # compared in the checkpoint's dtype: a bf16 checkpoint stores the slopes rounded to bf16
    expected = torch.tensor(get_alibi_slopes(n_head), dtype=torch.float64).to(slopes.dtype).float()
    rtol = 4 * torch.finfo(slopes.dtype).eps
    if slopes.numel() != n_head or not torch.allclose(slopes.float().flatten(), expected, rtol=rtol, atol=0):
        raise ValueError("transformer.relative_pe.slopes differ from ALiBi's slopes for "
                         f"{n_head} heads; the model would compute other attention biases")


def remap_state_dict_hf_btlm(state_dict, config):
    """BTLM checkpoint state dict (``transformer.h.{i}.attn.c_attn``, ...) -> GPTLMHeadModel state dict (config:
    the converted GPT2Config). Unknown keys raise KeyError; ALiBi slopes other than the paper's raise ValueError."""
    state_dict = OrderedDict(state_dict)
    out = OrderedDict()
    _remap_embeddings_and_head(state_dict, out, config, "transformer.wte.weight", tie_default=True)
    wpe = state_dict.pop("transformer.wpe.weight", None)
    if wpe is not None:
        out["transformer.embeddings.position_embeddings.weight"] = wpe
    slopes = state_dict.pop("transformer.relative_pe.slopes", None)
    if slopes is not None:
        _check_slopes(slopes, config.n_head)
    for kind in ("weight", "bias"):
        out[f"transformer.ln_f.{kind}"] = state_dict.pop(f"transformer.ln_f.{kind}")
    for layer in range(config.n_layer):
        src, dst = f"transformer.h.{layer}.", f"transformer.layers.{layer}."
        for kind in ("weight", "bias"):
            _move_params(state_dict, out, src, dst, _NORMS, kind)
            for name, ours in _CONV1D.items():
                value = state_dict.pop(f"{src}{name}.{kind}", None)
                if value is not None:
                    out[f"{dst}{ours}.{kind}"] = value.t() if kind == "weight" else value
            fc = state_dict.pop(f"{src}mlp.c_fc.{kind}", None)
            if fc is None:
                continue
            gate = state_dict.pop(f"{src}mlp.c_fc2.{kind}", None)
            fc1 = fc if gate is None else torch.cat([fc, gate], dim=-1)  # (in, [value, gate]) or ([value, gate],)
            out[f"{dst}mlp.fc1.{kind}"] = fc1.t() if kind == "weight" else fc1
        for buffer in ("attn.bias", "attn.masked_bias"):  # GPT-2's causal-mask buffers, if a version saved them
            state_dict.pop(src + buffer, None)
    if state_dict:
        raise KeyError(f"unexpected keys in BTLM state dict: {sorted(state_dict)[:5]}")
    return out


def inv_remap_state_dict_hf_btlm(state_dict, config):
    """GPTLMHeadModel state dict -> BTLM checkpoint state dict (inverse of remap_state_dict_hf_btlm; padded
    vocabulary rows are dropped; ALiBi models get ``transformer.relative_pe.slopes`` (n_head, 1); the tied
    ``lm_head.weight`` is included, as BTLMLMHeadModel.state_dict() has it)."""
    state_dict = OrderedDict(state_dict)
    out = OrderedDict()
    _inv_remap_embeddings_and_head(state_dict, out, config, "transformer.wte.weight", keep_tied=True)
    wpe = state_dict.pop("transformer.embeddings.position_embeddings.weight", None)
    if wpe is not None:
        out["transformer.wpe.weight"] = wpe
    if getattr(config, "use_alibi", False):
        out["transformer.relative_pe.slopes"] = torch.tensor(get_alibi_slopes(config.n_head))[:, None]
    for kind in ("weight", "bias"):
        out[f"transformer.ln_f.{kind}"] = state_dict.pop(f"transformer.ln_f.{kind}")
    gated = config.activation_function == "swiglu"
    for layer in range(config.n_layer):
        src, dst = f"transformer.layers.{layer}.", f"transformer.h.{layer}."
        for kind in ("weight", "bias"):
            _move_params(state_dict, out, src, dst, {ours: hf for hf, ours in _NORMS.items()}, kind)
            for name, ours in _CONV1D.items():
                value = state_dict.pop(f"{src}{ours}.{kind}", None)
                if value is not None:
                    out[f"{dst}{name}.{kind}"] = value.t() if kind == "weight" else value
            fc1 = state_dict.pop(f"{src}mlp.fc1.{kind}", None)
            if fc1 is None:
                continue
            fc1 = fc1.t() if kind == "weight" else fc1  # (in, [value, gate]) or ([value, gate],)
            if gated:
                out[f"{dst}mlp.c_fc.{kind}"], out[f"{dst}mlp.c_fc2.{kind}"] = fc1.chunk(2, dim=-1)
            else:
                out[f"{dst}mlp.c_fc.{kind}"] = fc1
    if state_dict:
        raise KeyError(f"unexpected keys in GPTLMHeadModel state dict: {sorted(state_dict)[:5]}")
    return out


# --------------------------------------------------------------------------------------------- muP training
# Parameter kinds, by what muP does with them (Yang et al. 2022, Table 3, Adam; BTLM multiplies the LM head's input
# by mup_output_alpha * mup_width_scale, the "readout multiplier" form, in which the output weights behave like the
# embedding: width-independent init and learning rate).
_HIDDEN, _RESIDUAL, _EMBEDDING, _READOUT, _BIAS, _NORM = "hidden", "residual", "embedding", "readout", "bias", "norm"
# Modules whose output is added to the residual stream: their init is also scaled by 1 / sqrt(2 * n_layer).
_RESIDUAL_WRITERS = ("out_proj", "fc2")


def _unwrap(model):
    # DistributedDataParallel (and similar wrappers) keep the model as .module; FSDP2 keeps the module tree.
    return getattr(model, "module", model)


def _width_scale(config, width_scale=None):
    w = getattr(config, "mup_width_scale", None) if width_scale is None else width_scale
    w = 1.0 if w is None else float(w)
    if not w > 0:
        raise ValueError(f"mup_width_scale must be > 0, got {w}")
    return w


def _is_norm(module):
    # nn.LayerNorm, nn.RMSNorm and flash_attn's RMSNorm: 1-D weight (and bias) applied per feature.
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("RMSNorm")


def mup_param_kinds(model):
    """{parameter name: kind} for every distinct parameter of a GPTModel / GPTLMHeadModel (a tied LM head is the
    embedding's tensor, listed once, as ``embedding``). Kinds: ``hidden`` (Wqkv, fc1, other inner matrices),
    ``residual`` (out_proj, fc2: hidden matrices that write into the residual stream), ``embedding``,
    ``readout`` (an untied LM head), ``bias``, ``norm``. A parameter of any other module raises ValueError: muP
    must know whether it is width-like or not."""
    model = _unwrap(model)
    lm_head = getattr(model, "lm_head", None)
    kinds = {}  # id -> kind
    # Embeddings first, so a tied LM head keeps the embedding's kind whatever the module order.
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            kinds[id(module.weight)] = _EMBEDDING
    for name, module in model.named_modules():
        direct = dict(module.named_parameters(recurse=False))
        if not direct:
            continue
        if isinstance(module, nn.Embedding):
            continue
        if isinstance(module, nn.Linear):
            if module is lm_head:
                weight_kind = _READOUT
            elif name.rsplit(".", 1)[-1] in _RESIDUAL_WRITERS:
                weight_kind = _RESIDUAL
            else:
                weight_kind = _HIDDEN
            kinds.setdefault(id(module.weight), weight_kind)
            if module.bias is not None:
                kinds.setdefault(id(module.bias), _BIAS)
        elif _is_norm(module):
            for pname, p in direct.items():
                kinds.setdefault(id(p), _NORM if pname == "weight" else _BIAS)
        else:
            raise ValueError(f"muP does not know how to treat the parameters of {name!r} "
                             f"({type(module).__name__}: {sorted(direct)})")
    out = {}
    for name, p in model.named_parameters():  # named_parameters lists a shared tensor once
        out[name] = kinds[id(p)]
    return out


@torch.no_grad()
def mup_init_(model, config=None):
    """Initialise a GPTModel / GPTLMHeadModel in place with BTLM's muP rules (config: the converted GPT2Config;
    default ``model.config``). With ``sigma = initializer_range`` and ``w = mup_width_scale``:

    * word (and learned position) embeddings, and an untied LM head: N(0, sigma);
    * hidden matrices (Wqkv, fc1): N(0, sigma * sqrt(w)), so their variance falls as 1 / width (fan-in);
    * out_proj, fc2: N(0, sigma * sqrt(w) / sqrt(2 * n_layer)) (GPT-2's depth scaling on top);
    * biases 0, norm weights 1.

    Returns the model."""
    inner = _unwrap(model)
    config = inner.config if config is None else config
    sigma = float(getattr(config, "initializer_range", None) or 0.02)
    hidden_std = sigma * math.sqrt(_width_scale(config))
    std = {_EMBEDDING: sigma, _READOUT: sigma, _HIDDEN: hidden_std,
           _RESIDUAL: hidden_std / math.sqrt(2 * config.n_layer)}
    params = dict(inner.named_parameters())
    for name, kind in mup_param_kinds(inner).items():
        p = params[name]
        if kind in std:
            nn.init.normal_(p, mean=0.0, std=std[kind])
        elif kind == _NORM:
            nn.init.ones_(p)
        else:
            nn.init.zeros_(p)
    return model


def mup_param_groups(model, lr, weight_decay=0.0, width_scale=None):
    """Optimizer parameter groups with muP's Adam learning rates for a BTLM-shaped GPTModel / GPTLMHeadModel
    (plain, DDP- or FSDP2-wrapped). ``w = width_scale`` (default: the model config's ``mup_width_scale``).

    * ``hidden``: every inner matrix (Wqkv, out_proj, fc1, fc2): ``lr * w``, ``weight_decay``. Adam's update
      size does not shrink with fan-in, so muP shrinks the rate: each output coordinate of a width-d matrix sums d
      updates, and ``lr * d_base / d`` keeps that sum width-independent.
    * ``embedding``: word / position embeddings and an untied LM head: ``lr``, ``weight_decay``.
    * ``no_decay``: biases and norm parameters: ``lr``, weight decay 0.

    Each group carries ``name`` and ``lr_multiplier``; empty groups are left out. Every trainable parameter is in
    exactly one group. With torch's AdamW the decoupled decay is ``lr * weight_decay`` per step, so the hidden
    matrices' decay shrinks with their rate, as in Cerebras' recipe."""
    inner = _unwrap(model)
    w = _width_scale(getattr(inner, "config", None), width_scale)
    spec = {  # group name -> (lr multiplier, weight decay, kinds)
        "hidden": (w, weight_decay, (_HIDDEN, _RESIDUAL)),
        "embedding": (1.0, weight_decay, (_EMBEDDING, _READOUT)),
        "no_decay": (1.0, 0.0, (_BIAS, _NORM)),
    }
    kinds = mup_param_kinds(model)
    named = dict(_unwrap(model).named_parameters())
    groups = []
    for group_name, (mult, decay, members) in spec.items():
        params = [named[n] for n, k in kinds.items() if k in members and named[n].requires_grad]
        if params:
            groups.append({"params": params, "lr": lr * mult, "weight_decay": decay, "name": group_name,
                           "lr_multiplier": mult})
    return groups
