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
"""
from collections import OrderedDict

import torch
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
