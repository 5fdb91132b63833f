"""LLaMA (Touvron et al. 2023) as a ``GPTLMHeadModel``: config conversion and HF checkpoint remapping.

A LLaMA layer is a pre-norm block with RMSNorm, rotary attention (optionally grouped-query), a SwiGLU MLP and
no biases, which :mod:`flash_attn.models.gpt` builds from a GPT2Config with ``rms_norm``,
``rotary_emb_fraction=1``, ``activation_function="swiglu"`` and ``n_head_kv``.

Weight layout, as in FlashAttention 2 (so its LLaMA checkpoints load unchanged):
  * q/k projections keep Meta's original row order, i.e. *interleaved* rotary pairs (2i, 2i + 1).
    HF checkpoints permute those rows so that rotary pairs are (i, i + d/2) (``rotate_half``); the remap
    undoes that permutation and the model runs with ``rotary_emb_interleaved=True``. Both give the same
    attention scores, since q and k are permuted alike.
  * ``mlp.fc1`` is [up_proj; gate_proj] (value first, gate second; GatedMlp's order).
"""
from collections import OrderedDict

import torch
from transformers import GPT2Config

from flash_attn.models.gpt import _inv_remap_embeddings_and_head, _remap_embeddings_and_head, rope_inv_freq


def _rope(llama_config):
    """(theta, scaling dict or None) from an HF LlamaConfig, old (rope_theta/rope_scaling) or new
    (rope_parameters) style."""
    params = getattr(llama_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(llama_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(llama_config, "rope_theta", 10000.0))
    theta = float(params.get("rope_theta", getattr(llama_config, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    rope_inv_freq(2, theta, scaling)  # raises NotImplementedError for unsupported types (dynamic, yarn, ...)
    return theta, scaling


def llama_config_to_gpt2_config(llama_config):
    """HF LlamaConfig -> GPT2Config for GPTLMHeadModel (RMSNorm, SwiGLU, interleaved rotary, GQA, no bias)."""
    hidden, heads = llama_config.hidden_size, llama_config.num_attention_heads
    head_dim = getattr(llama_config, "head_dim", None) or hidden // heads
    if head_dim * heads != hidden:
        raise NotImplementedError(f"head_dim ({head_dim}) * num_attention_heads ({heads}) != hidden_size "
                                  f"({hidden}) is not supported (MHA's head_dim is hidden_size // num_heads)")
    act = getattr(llama_config, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r}: only SwiGLU (hidden_act='silu') LLaMA MLPs are supported")
    theta, scaling = _rope(llama_config)
    attention_bias = bool(getattr(llama_config, "attention_bias", False))
    mlp_bias = bool(getattr(llama_config, "mlp_bias", False))
    return GPT2Config(
        vocab_size=llama_config.vocab_size,
        n_positions=0,  # positions come from rotary embeddings only
        n_embd=hidden,
        n_layer=llama_config.num_hidden_layers,
        n_head=heads,
        n_inner=llama_config.intermediate_size,
        activation_function="swiglu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=float(getattr(llama_config, "attention_dropout", 0.0) or 0.0),
        layer_norm_epsilon=llama_config.rms_norm_eps,
        initializer_range=llama_config.initializer_range,
        bos_token_id=llama_config.bos_token_id,
        eos_token_id=llama_config.eos_token_id,
        pad_token_id=llama_config.pad_token_id,
        tie_word_embeddings=bool(getattr(llama_config, "tie_word_embeddings", False)),
        # The fields below are read by flash_attn.models.gpt.
        n_head_kv=getattr(llama_config, "num_key_value_heads", None) or heads,
        rms_norm=True,
        rotary_emb_fraction=1.0,
        rotary_emb_interleaved=True,
        rotary_emb_base=theta,
        rotary_emb_scaling=scaling,
        qkv_proj_bias=attention_bias,
        out_proj_bias=attention_bias,
        mlp_fc1_bias=mlp_bias,
        mlp_fc2_bias=mlp_bias,
        mlp_multiple_of=1,  # intermediate_size is exact in HF configs
    )


# The q/k row permutation between Meta's interleaved rotary pairs and HF's rotate-half halves, per head of d
# rows: HF row (half, i) holds Meta row (i, half), i.e. HF = Meta viewed (d/2, 2) and transposed.
def _hf_to_interleaved(w, nheads):
    d = w.shape[0] // nheads
    return w.reshape(nheads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _interleaved_to_hf(w, nheads):
    d = w.shape[0] // nheads
    return w.reshape(nheads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _n_head_kv(config):
    return getattr(config, "n_head_kv", None) or config.n_head


def remap_state_dict_hf_llama(state_dict, config):
    """HF LlamaForCausalLM state dict -> GPTLMHeadModel state dict (config: the converted GPT2Config)."""
    state_dict = OrderedDict(state_dict)
    out = OrderedDict()
    _remap_embeddings_and_head(state_dict, out, config, "model.embed_tokens.weight")
    out["transformer.ln_f.weight"] = state_dict.pop("model.norm.weight")
    n_head, n_head_kv = config.n_head, _n_head_kv(config)
    for layer in range(config.n_layer):
        src, dst = f"model.layers.{layer}.", f"transformer.layers.{layer}."
        out[dst + "norm1.weight"] = state_dict.pop(src + "input_layernorm.weight")
        out[dst + "norm2.weight"] = state_dict.pop(src + "post_attention_layernorm.weight")
        for kind in ("weight", "bias"):
            q = state_dict.pop(f"{src}self_attn.q_proj.{kind}", None)
            if q is None:
                continue
            k = state_dict.pop(f"{src}self_attn.k_proj.{kind}")
            v = state_dict.pop(f"{src}self_attn.v_proj.{kind}")
            out[f"{dst}mixer.Wqkv.{kind}"] = torch.cat(
                [_hf_to_interleaved(q, n_head), _hf_to_interleaved(k, n_head_kv), v], dim=0)
            out[f"{dst}mixer.out_proj.{kind}"] = state_dict.pop(f"{src}self_attn.o_proj.{kind}")
        for kind in ("weight", "bias"):
            gate = state_dict.pop(f"{src}mlp.gate_proj.{kind}", None)
            if gate is None:
                continue
            up = state_dict.pop(f"{src}mlp.up_proj.{kind}")
            out[f"{dst}mlp.fc1.{kind}"] = torch.cat([up, gate], dim=0)
            out[f"{dst}mlp.fc2.{kind}"] = state_dict.pop(f"{src}mlp.down_proj.{kind}")
        state_dict.pop(src + "self_attn.rotary_emb.inv_freq", None)  # old HF versions stored it
    state_dict.pop("model.rotary_emb.inv_freq", None)
    if state_dict:
        raise KeyError(f"unexpected keys in LLaMA state dict: {sorted(state_dict)[:5]}")
    return out


def inv_remap_state_dict_hf_llama(state_dict, config):
    """GPTLMHeadModel state dict -> HF LlamaForCausalLM state dict (inverse of remap_state_dict_hf_llama;
    padded vocabulary rows are dropped)."""
    state_dict = OrderedDict(state_dict)
    out = OrderedDict()
    _inv_remap_embeddings_and_head(state_dict, out, config, "model.embed_tokens.weight")
    out["model.norm.weight"] = state_dict.pop("transformer.ln_f.weight")
    n_head, n_head_kv = config.n_head, _n_head_kv(config)
    head_dim = config.n_embd // n_head
    for layer in range(config.n_layer):
        src, dst = f"transformer.layers.{layer}.", f"model.layers.{layer}."
        out[dst + "input_layernorm.weight"] = state_dict.pop(src + "norm1.weight")
        out[dst + "post_attention_layernorm.weight"] = state_dict.pop(src + "norm2.weight")
        for kind in ("weight", "bias"):
            wqkv = state_dict.pop(f"{src}mixer.Wqkv.{kind}", None)
            if wqkv is None:
                continue
            q, k, v = wqkv.split([n_head * head_dim, n_head_kv * head_dim, n_head_kv * head_dim], dim=0)
            out[f"{dst}self_attn.q_proj.{kind}"] = _interleaved_to_hf(q, n_head)
            out[f"{dst}self_attn.k_proj.{kind}"] = _interleaved_to_hf(k, n_head_kv)
            out[f"{dst}self_attn.v_proj.{kind}"] = v
            out[f"{dst}self_attn.o_proj.{kind}"] = state_dict.pop(f"{src}mixer.out_proj.{kind}")
        for kind in ("weight", "bias"):
            fc1 = state_dict.pop(f"{src}mlp.fc1.{kind}", None)
            if fc1 is None:
                continue
            up, gate = fc1.chunk(2, dim=0)
            out[f"{dst}mlp.gate_proj.{kind}"] = gate
            out[f"{dst}mlp.up_proj.{kind}"] = up
            out[f"{dst}mlp.down_proj.{kind}"] = state_dict.pop(f"{src}mlp.fc2.{kind}")
    if state_dict:
        raise KeyError(f"unexpected keys in GPTLMHeadModel state dict: {sorted(state_dict)[:5]}")
    return out
