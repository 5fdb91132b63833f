"""Baichuan (Baichuan-7B / -13B, Baichuan Inc. 2023) and Baichuan 2 (Yang et al. 2023, "Baichuan 2: Open
Large-scale Language Models") as a ``GPTLMHeadModel``: config conversion and checkpoint remapping.

Baichuan models are remote code on the Hugging Face Hub (``trust_remote_code``), not transformers classes. A
Baichuan layer is a LLaMA layer: pre-norm RMSNorm, attention without biases, a SwiGLU MLP (``gate_proj``,
``up_proj``, ``down_proj``), an untied LM head. What differs:

* q, k, v come from one fused projection ``self_attn.W_pack`` whose rows are [q; k; v], each head-major: already
  ``mixer.Wqkv``'s layout, so it is copied unchanged;
* positions: the 7B models rotate q and k (rotate-half pairs (i, i + d/2), i.e. *non-interleaved*, base 10000);
  the 13B models use ALiBi (Press et al. 2022) with the paper's slopes instead;
* Baichuan 2's LM head (``NormHead``) L2-normalizes each vocabulary row of its weight before the product.

The published configs name neither the position scheme nor the head type, so, as in FA2, they are read off the
published sizes: ALiBi for ``hidden_size >= 5000`` (13B: 5120; 7B: 4096) and the normalized head for
``vocab_size > 70000`` (Baichuan 2: 125,696 tokens; Baichuan: 64,000). ``baichuan_config_to_gpt2_config``'s
``use_alibi`` / ``norm_head`` arguments override the rule.
"""
from collections import OrderedDict

import torch
from transformers import GPT2Config

from flash_attn.models.gpt import _inv_remap_embeddings_and_head, _remap_embeddings_and_head


def baichuan_config_to_gpt2_config(baichuan_config, use_alibi=None, norm_head=None):
    """Baichuan / Baichuan 2 config -> GPT2Config for GPTLMHeadModel.

    use_alibi, norm_head: None (default) infers them from hidden_size and vocab_size as the module docstring says.
    """
    c = baichuan_config
    hidden, heads = c.hidden_size, c.num_attention_heads
    if hidden % heads != 0:
        raise ValueError(f"hidden_size ({hidden}) must be divisible by num_attention_heads ({heads})")
    act = getattr(c, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r}: only SwiGLU (hidden_act='silu') Baichuan MLPs are supported")
    use_alibi = hidden >= 5000 if use_alibi is None else bool(use_alibi)
    if not use_alibi and (hidden // heads) % 2 != 0:
        raise ValueError(f"rotary Baichuan needs an even head dim, got hidden_size // num_attention_heads = "
                         f"{hidden // heads}")
    norm_head = c.vocab_size > 70000 if norm_head is None else bool(norm_head)
    return GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=0,  # no absolute position embedding
        n_embd=hidden,
        n_layer=c.num_hidden_layers,
        n_head=heads,
        n_inner=c.intermediate_size,
        activation_function="swiglu",
        resid_pdrop=0.0,  # the published code has no dropout
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=c.rms_norm_eps,
        initializer_range=getattr(c, "initializer_range", 0.02),
        bos_token_id=getattr(c, "bos_token_id", None),
        eos_token_id=getattr(c, "eos_token_id", None),
        pad_token_id=getattr(c, "pad_token_id", None),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        # The fields below are read by flash_attn.models.gpt.
        rms_norm=True,
        rotary_emb_fraction=0.0 if use_alibi else 1.0,
        rotary_emb_base=10000.0,
        rotary_emb_interleaved=False,
        use_alibi=use_alibi,
        norm_head=norm_head,
        qkv_proj_bias=False,
        out_proj_bias=False,
        mlp_fc1_bias=False,
        mlp_fc2_bias=False,
        mlp_multiple_of=1,  # intermediate_size is exact in the published configs
    )


def remap_state_dict_hf_baichuan(state_dict, config):
    """Baichuan / Baichuan 2 checkpoint state dict (``model.layers.{i}.self_attn.W_pack``, ...) ->
    GPTLMHeadModel state dict (config: the converted GPT2Config).

    ``mlp.fc1`` is [up_proj; gate_proj] (GatedMlp's value, then gate). Rotary ``inv_freq`` buffers are dropped;
    unknown keys raise KeyError.
    """
    state_dict = OrderedDict(state_dict)
    out = OrderedDict()
    _remap_embeddings_and_head(state_dict, out, config, "model.embed_tokens.weight")
    out["transformer.ln_f.weight"] = state_dict.pop("model.norm.weight")
    for layer in range(config.n_layer):
        src, dst = f"model.layers.{layer}.", f"transformer.layers.{layer}."
        out[dst + "norm1.weight"] = state_dict.pop(src + "input_layernorm.weight")
        out[dst + "norm2.weight"] = state_dict.pop(src + "post_attention_layernorm.weight")
        out[dst + "mixer.Wqkv.weight"] = state_dict.pop(src + "self_attn.W_pack.weight")
        out[dst + "mixer.out_proj.weight"] = state_dict.pop(src + "self_attn.o_proj.weight")
        gate, up = state_dict.pop(src + "mlp.gate_proj.weight"), state_dict.pop(src + "mlp.up_proj.weight")
        out[dst + "mlp.fc1.weight"] = torch.cat([up, gate], dim=0)
        out[dst + "mlp.fc2.weight"] = state_dict.pop(src + "mlp.down_proj.weight")
        state_dict.pop(src + "self_attn.rotary_emb.inv_freq", None)
    if state_dict:
        raise KeyError(f"unexpected keys in Baichuan state dict: {sorted(state_dict)[:5]}")
    return out


def inv_remap_state_dict_hf_baichuan(state_dict, config):
    """GPTLMHeadModel state dict -> Baichuan checkpoint state dict (inverse of remap_state_dict_hf_baichuan;
    padded vocabulary rows are dropped; no rotary ``inv_freq`` buffers are written)."""
    state_dict = OrderedDict(state_dict)
    out = OrderedDict()
    _inv_remap_embeddings_and_head(state_dict, out, config, "model.embed_tokens.weight")
    out["model.norm.weight"] = state_dict.pop("transformer.ln_f.weight")
    for layer in range(config.n_layer):
        src, dst = f"transformer.layers.{layer}.", f"model.layers.{layer}."
        out[dst + "input_layernorm.weight"] = state_dict.pop(src + "norm1.weight")
        out[dst + "post_attention_layernorm.weight"] = state_dict.pop(src + "norm2.weight")
        out[dst + "self_attn.W_pack.weight"] = state_dict.pop(src + "mixer.Wqkv.weight")
        out[dst + "self_attn.o_proj.weight"] = state_dict.pop(src + "mixer.out_proj.weight")
        up, gate = state_dict.pop(src + "mlp.fc1.weight").chunk(2, dim=0)
        out[dst + "mlp.gate_proj.weight"] = gate
        out[dst + "mlp.up_proj.weight"] = up
        out[dst + "mlp.down_proj.weight"] = state_dict.pop(src + "mlp.fc2.weight")
    if state_dict:
        raise KeyError(f"unexpected keys in GPTLMHeadModel state dict: {sorted(state_dict)[:5]}")
    return out
