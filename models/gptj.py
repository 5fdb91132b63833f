"""GPT-J (Wang & Komatsuzaki 2021) as a ``GPTLMHeadModel``: config conversion and HF checkpoint remapping.

A GPT-J layer runs attention and MLP in parallel on *one* LayerNorm of the residual and adds both to it:
:class:`flash_attn.modules.block.ParallelBlock` with ``tied_norm`` (``parallel_block_tied_norm=True``), so a
layer has ``norm1`` only. Attention has no biases and rotates the first ``rotary_dim`` dims of each head
with *interleaved* pairs (2i, 2i + 1) (``rotate_every_two``), base 10000; the MLP has biases; the LM head is
untied and has a bias.

Weight layout: HF's separate q/k/v projections are concatenated into ``mixer.Wqkv`` as [q; k; v]; both sides
use the interleaved rotary layout, so no row permutation is needed.
"""
from collections import OrderedDict

import torch
from transformers import GPT2Config

from flash_attn.models.gpt import _inv_remap_embeddings_and_head, _move_params, _remap_embeddings_and_head


def gptj_config_to_gpt2_config(gptj_config):
    """HF GPTJConfig -> GPT2Config for GPTLMHeadModel (tied-norm parallel block, interleaved partial rotary)."""
    c = gptj_config
    head_dim = c.n_embd // c.n_head
    if head_dim * c.n_head != c.n_embd:
        raise ValueError(f"n_embd ({c.n_embd}) must be divisible by n_head ({c.n_head})")
    rotary_dim = getattr(c, "rotary_dim", None) or head_dim
    return GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=0,  # positions come from rotary embeddings only
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=getattr(c, "n_inner", None),
        activation_function=c.activation_function,
        resid_pdrop=c.resid_pdrop,
        embd_pdrop=c.embd_pdrop,
        attn_pdrop=c.attn_pdrop,
        layer_norm_epsilon=c.layer_norm_epsilon,
        initializer_range=c.initializer_range,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=getattr(c, "pad_token_id", None),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        # The fields below are read by flash_attn.models.gpt.
        rotary_emb_fraction=rotary_dim / head_dim,
        rotary_emb_base=10000.0,
        rotary_emb_interleaved=True,
        parallel_block=True,
        parallel_block_tied_norm=True,
        qkv_proj_bias=False,
        out_proj_bias=False,
        mlp_fc1_bias=True,
        mlp_fc2_bias=True,
        lm_head_bias=True,
    )


_LAYER_NAMES = {  # HF name inside transformer.h.{i} -> ours inside transformer.layers.{i}
    "ln_1": "norm1",
    "attn.out_proj": "mixer.out_proj",
    "mlp.fc_in": "mlp.fc1",
    "mlp.fc_out": "mlp.fc2",
}
_INV_LAYER_NAMES = {ours: hf for hf, ours in _LAYER_NAMES.items()}


def remap_state_dict_hf_gptj(state_dict, config):
    """HF GPTJForCausalLM state dict -> GPTLMHeadModel state dict (config: the converted GPT2Config).
    The causal-mask / sinusoid buffers old versions stored are dropped."""
    state_dict = OrderedDict(state_dict)
    out = OrderedDict()
    _remap_embeddings_and_head(state_dict, out, config, "transformer.wte.weight")
    lm_head_bias = state_dict.pop("lm_head.bias", None)
    if lm_head_bias is not None:
        rows = out["lm_head.weight"].shape[0]
        out["lm_head.bias"] = torch.nn.functional.pad(lm_head_bias, (0, rows - lm_head_bias.shape[0]))
    for kind in ("weight", "bias"):
        out[f"transformer.ln_f.{kind}"] = state_dict.pop(f"transformer.ln_f.{kind}")
    for layer in range(config.n_layer):
        src, dst = f"transformer.h.{layer}.", f"transformer.layers.{layer}."
        for kind in ("weight", "bias"):
            q = state_dict.pop(f"{src}attn.q_proj.{kind}", None)
            if q is not None:
                k = state_dict.pop(f"{src}attn.k_proj.{kind}")
                v = state_dict.pop(f"{src}attn.v_proj.{kind}")
                out[f"{dst}mixer.Wqkv.{kind}"] = torch.cat([q, k, v], dim=0)
            _move_params(state_dict, out, src, dst, _LAYER_NAMES, kind)
        for buffer in ("attn.bias", "attn.masked_bias", "attn.embed_positions"):
            state_dict.pop(src + buffer, None)
    if state_dict:
        raise KeyError(f"unexpected keys in GPT-J state dict: {sorted(state_dict)[:5]}")
    return out


def inv_remap_state_dict_hf_gptj(state_dict, config):
    """GPTLMHeadModel state dict -> HF GPTJForCausalLM state dict (inverse of remap_state_dict_hf_gptj;
    padded vocabulary rows are dropped)."""
    state_dict = OrderedDict(state_dict)
    vocab = config.vocab_size
    out = OrderedDict()
    _inv_remap_embeddings_and_head(state_dict, out, config, "transformer.wte.weight")
    lm_head_bias = state_dict.pop("lm_head.bias", None)
    if lm_head_bias is not None:
        out["lm_head.bias"] = lm_head_bias[:vocab]
    for kind in ("weight", "bias"):
        out[f"transformer.ln_f.{kind}"] = state_dict.pop(f"transformer.ln_f.{kind}")
    for layer in range(config.n_layer):
        src, dst = f"transformer.layers.{layer}.", f"transformer.h.{layer}."
        for kind in ("weight", "bias"):
            wqkv = state_dict.pop(f"{src}mixer.Wqkv.{kind}", None)
            if wqkv is not None:
                q, k, v = wqkv.chunk(3, dim=0)
                out[f"{dst}attn.q_proj.{kind}"] = q
                out[f"{dst}attn.k_proj.{kind}"] = k
                out[f"{dst}attn.v_proj.{kind}"] = v
            _move_params(state_dict, out, src, dst, _INV_LAYER_NAMES, kind)
    if state_dict:
        raise KeyError(f"unexpected keys in GPTLMHeadModel state dict: {sorted(state_dict)[:5]}")
    return out
