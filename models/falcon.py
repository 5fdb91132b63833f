"""Falcon (Almazrouei et al. 2023) as a ``GPTLMHeadModel``: config conversion and HF checkpoint remapping.

Falcon layers use LayerNorm, rotary embeddings over the whole head (rotate-half pairs, i.e.
*non-interleaved*), a plain MLP and, by default, no biases. Three layer shapes:

* ``new_decoder_architecture`` (Falcon-40B/180B): parallel attention and MLP, grouped-query attention with
  ``num_kv_heads`` heads, and two LayerNorms (``ln_attn``, ``ln_mlp``; ``num_ln_in_parallel_attn=2``, the
  default) or one (``input_layernorm``; ``num_ln_in_parallel_attn=1``): ``ParallelBlock`` with untied or
  tied norms.
* ``parallel_attn`` (Falcon-7B): parallel attention and MLP on one ``input_layernorm`` (tied
  ``ParallelBlock``); ``multi_query`` gives a single k/v head, otherwise every head has its own.
* neither: a sequential pre-norm ``Block`` (``input_layernorm``, ``post_attention_layernorm``).

The LM head is tied to the word embedding by default (untied heads are supported) and has no bias.
ALiBi Falcons (``alibi=True``, e.g. falcon-rw) are refused with ``NotImplementedError``.

Weight layout of the fused ``query_key_value`` projection; ``mixer.Wqkv`` wants rows (q heads, k heads, v heads):

* new architecture: rows (kv group, [q_0 .. q_{r-1}, k, v], head_dim) with r = num_heads // num_kv_heads;
* multi-query: rows (q_0 .. q_{H-1}, k, v): already our layout;
* otherwise: rows (head, {q, k, v}, head_dim), as in GPT-NeoX.
"""
from collections import OrderedDict

import torch
from transformers import GPT2Config

from flash_attn.models.gpt import (_inv_remap_embeddings_and_head, _move_params, _remap_embeddings_and_head,
                                   rope_inv_freq)


def _rope(falcon_config):
    """(theta, rotary fraction, scaling dict or None) from an HF FalconConfig."""
    params = getattr(falcon_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(falcon_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(falcon_config, "rope_theta", 10000.0))
    theta = float(params.get("rope_theta", 10000.0))
    fraction = float(params.get("partial_rotary_factor", 1.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, fraction, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    rope_inv_freq(2, theta, scaling)  # raises NotImplementedError for unsupported types (dynamic, yarn, ...)
    return theta, fraction, scaling


def _layout(c):
    """'new', 'multi_query' or 'per_head': how query_key_value's rows are ordered."""
    if getattr(c, "new_decoder_architecture", False):
        return "new"
    return "multi_query" if getattr(c, "multi_query", True) else "per_head"


def _num_ln_in_parallel_attn(c):
    n = getattr(c, "num_ln_in_parallel_attn", None)
    if getattr(c, "new_decoder_architecture", False):
        return 2 if n is None else n
    return 1


def falcon_config_to_gpt2_config(falcon_config):
    """HF FalconConfig -> GPT2Config for GPTLMHeadModel (rotary Falcons of all three layer shapes)."""
    c = falcon_config
    hidden, heads = c.hidden_size, c.num_attention_heads
    if hidden % heads != 0:
        raise ValueError(f"hidden_size ({hidden}) must be divisible by num_attention_heads ({heads})")
    if getattr(c, "alibi", False):
        raise NotImplementedError("Falcon with alibi=True is not supported; only rotary Falcons convert")
    new_arch = bool(getattr(c, "new_decoder_architecture", False))
    if not new_arch and getattr(c, "parallel_attn", True) and getattr(c, "num_ln_in_parallel_attn", None) == 2:
        raise NotImplementedError("num_ln_in_parallel_attn=2 needs new_decoder_architecture=True in Falcon")
    if _num_ln_in_parallel_attn(c) not in (1, 2):
        raise ValueError(f"num_ln_in_parallel_attn must be 1 or 2, got {c.num_ln_in_parallel_attn}")
    layout = _layout(c)
    n_head_kv = {"new": getattr(c, "num_kv_heads", None) or heads, "multi_query": 1, "per_head": heads}[layout]
    if heads % n_head_kv != 0:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_kv_heads ({n_head_kv})")
    theta, fraction, scaling = _rope(c)
    bias = bool(getattr(c, "bias", False))
    hidden_dropout = float(getattr(c, "hidden_dropout", 0.0) or 0.0)
    parallel = new_arch or bool(getattr(c, "parallel_attn", True))
    return GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=0,  # positions come from rotary embeddings only
        n_embd=hidden,
        n_layer=c.num_hidden_layers,
        n_head=heads,
        n_inner=getattr(c, "ffn_hidden_size", None) or 4 * hidden,
        activation_function=getattr(c, "activation", "gelu"),
        resid_pdrop=hidden_dropout,
        embd_pdrop=0.0,  # Falcon applies no dropout to the embeddings
        attn_pdrop=float(getattr(c, "attention_dropout", 0.0) or 0.0),
        layer_norm_epsilon=c.layer_norm_epsilon,
        initializer_range=c.initializer_range,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=getattr(c, "pad_token_id", None),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        # The fields below are read by flash_attn.models.gpt.
        n_head_kv=n_head_kv,
        rotary_emb_fraction=fraction,
        rotary_emb_base=theta,
        rotary_emb_scaling=scaling,
        rotary_emb_interleaved=False,
        parallel_block=parallel,
        parallel_block_tied_norm=parallel and _num_ln_in_parallel_attn(c) == 1,
        qkv_proj_bias=bias,
        out_proj_bias=bias,
        mlp_fc1_bias=bias,
        mlp_fc2_bias=bias,
        lm_head_bias=False,
        falcon_qkv_layout=layout,  # read by the remaps below only
    )


def _qkv_to_ours(w, config):
    layout, heads, kv = config.falcon_qkv_layout, config.n_head, config.n_head_kv
    if layout == "multi_query":
        return w
    if layout == "per_head":
        d = w.shape[0] // (3 * heads)
        return w.reshape(heads, 3, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
    r = heads // kv
    d = w.shape[0] // (heads + 2 * kv)
    g = w.reshape(kv, r + 2, d, *w.shape[1:])
    q, k, v = g[:, :r], g[:, r], g[:, r + 1]
    return torch.cat([q.reshape(heads * d, *w.shape[1:]), k.reshape(kv * d, *w.shape[1:]),
                      v.reshape(kv * d, *w.shape[1:])])


def _qkv_to_falcon(w, config):
    layout, heads, kv = config.falcon_qkv_layout, config.n_head, config.n_head_kv
    if layout == "multi_query":
        return w
    if layout == "per_head":
        d = w.shape[0] // (3 * heads)
        return w.reshape(3, heads, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
    r = heads // kv
    d = w.shape[0] // (heads + 2 * kv)
    q = w[:heads * d].reshape(kv, r, d, *w.shape[1:])
    k = w[heads * d:(heads + kv) * d].reshape(kv, 1, d, *w.shape[1:])
    v = w[(heads + kv) * d:].reshape(kv, 1, d, *w.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(w.shape)


def _layer_names(config):
    """HF name inside transformer.h.{i} -> ours inside transformer.layers.{i}."""
    names = {"self_attention.dense": "mixer.out_proj", "mlp.dense_h_to_4h": "mlp.fc1",
             "mlp.dense_4h_to_h": "mlp.fc2"}
    if not getattr(config, "parallel_block", False):
        names.update({"input_layernorm": "norm1", "post_attention_layernorm": "norm2"})
    elif getattr(config, "parallel_block_tied_norm", False):
        names["input_layernorm"] = "norm1"
    else:
        names.update({"ln_attn": "norm1", "ln_mlp": "norm2"})
    return names


def remap_state_dict_hf_falcon(state_dict, config):
    """HF FalconForCausalLM state dict -> GPTLMHeadModel state dict (config: the converted GPT2Config).

    Rotary inv_freq buffers of old versions are dropped; unknown keys raise KeyError.
    """
    state_dict = OrderedDict(state_dict)
    out = OrderedDict()
    _remap_embeddings_and_head(state_dict, out, config, "transformer.word_embeddings.weight", tie_default=True)
    for kind in ("weight", "bias"):
        out[f"transformer.ln_f.{kind}"] = state_dict.pop(f"transformer.ln_f.{kind}")
    names = _layer_names(config)
    for layer in range(config.n_layer):
        src, dst = f"transformer.h.{layer}.", f"transformer.layers.{layer}."
        for kind in ("weight", "bias"):
            qkv = state_dict.pop(f"{src}self_attention.query_key_value.{kind}", None)
            if qkv is not None:
                out[f"{dst}mixer.Wqkv.{kind}"] = _qkv_to_ours(qkv, config)
            _move_params(state_dict, out, src, dst, names, kind)
        state_dict.pop(f"{src}self_attention.rotary_emb.inv_freq", None)
    state_dict.pop("transformer.rotary_emb.inv_freq", None)
    if state_dict:
        raise KeyError(f"unexpected keys in Falcon state dict: {sorted(state_dict)[:5]}")
    return out


def inv_remap_state_dict_hf_falcon(state_dict, config):
    """GPTLMHeadModel state dict -> HF FalconForCausalLM state dict (inverse of remap_state_dict_hf_falcon;
    padded vocabulary rows are dropped; ``lm_head.weight`` is included, as FalconForCausalLM.state_dict()
    has it even when tied)."""
    state_dict = OrderedDict(state_dict)
    out = OrderedDict()
    _inv_remap_embeddings_and_head(state_dict, out, config, "transformer.word_embeddings.weight", keep_tied=True)
    for kind in ("weight", "bias"):
        out[f"transformer.ln_f.{kind}"] = state_dict.pop(f"transformer.ln_f.{kind}")
    inv_names = {ours: hf for hf, ours in _layer_names(config).items()}
    for layer in range(config.n_layer):
        src, dst = f"transformer.layers.{layer}.", f"transformer.h.{layer}."
        for kind in ("weight", "bias"):
            wqkv = state_dict.pop(f"{src}mixer.Wqkv.{kind}", None)
            if wqkv is not None:
                out[f"{dst}self_attention.query_key_value.{kind}"] = _qkv_to_falcon(wqkv, config)
            _move_params(state_dict, out, src, dst, inv_names, kind)
    if state_dict:
        raise KeyError(f"unexpected keys in GPTLMHeadModel state dict: {sorted(state_dict)[:5]}")
    return out
