"""GPTBigCode (SantaCoder, Allal et al. 2023; StarCoder, Li et al. 2023) as a ``GPTLMHeadModel``: config
conversion and HF checkpoint remapping.

A GPTBigCode layer is a GPT-2 layer (pre-norm LayerNorm, learned absolute positions, biased projections, a
tanh-GELU MLP, LM head tied to the word embedding) whose attention is multi-query by default
(``multi_query=True``: one key/value head shared by every query head; Shazeer 2019). HF stores its weights
in nn.Linear layout (out, in), so nothing is transposed.

Weight layout of the fused ``attn.c_attn`` projection; ``mixer.Wqkv`` wants rows (q heads, k heads, v heads):

* multi-query: rows [q (n_embd); k (head_dim); v (head_dim)]: already our layout, with ``n_head_kv = 1``, so the
  model keeps one k/v head (FA2 instead copied it to every head);
* ``multi_query=False``: rows (head, {q, k, v}, head_dim), permuted to ours.
"""
from collections import OrderedDict

from transformers import GPT2Config

from flash_attn.models.gpt import _inv_remap_embeddings_and_head, _move_params, _remap_embeddings_and_head


def bigcode_config_to_gpt2_config(bigcode_config):
    """HF GPTBigCodeConfig -> GPT2Config for GPTLMHeadModel (multi-query or multi-head attention)."""
    c = bigcode_config
    hidden, heads = c.n_embd, c.n_head
    if hidden % heads != 0:
        raise ValueError(f"n_embd ({hidden}) must be divisible by n_head ({heads})")
    if getattr(c, "add_cross_attention", False):
        raise NotImplementedError("GPTBigCode with add_cross_attention=True (an encoder-decoder layer) is not "
                                  "supported; only the decoder-only language model converts")
    multi_query = bool(getattr(c, "multi_query", True))
    return GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.n_positions,
        n_embd=hidden,
        n_layer=c.n_layer,
        n_head=heads,
        n_inner=getattr(c, "n_inner", None) or 4 * hidden,
        activation_function=c.activation_function,
        resid_pdrop=c.resid_pdrop,
        embd_pdrop=c.embd_pdrop,
        attn_pdrop=c.attn_pdrop,
        layer_norm_epsilon=c.layer_norm_epsilon,
        initializer_range=c.initializer_range,
        scale_attn_weights=getattr(c, "scale_attn_weights", True),
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=getattr(c, "pad_token_id", None),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        # The fields below are read by flash_attn.models.gpt.
        n_head_kv=1 if multi_query else heads,
        multi_query=multi_query,  # read by the remaps below
    )


def _per_head(config):
    return not getattr(config, "multi_query", True)


def _qkv_to_ours(w, config):
    if not _per_head(config):
        return w
    heads = config.n_head
    d = w.shape[0] // (3 * heads)
    return w.reshape(heads, 3, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _qkv_to_bigcode(w, config):
    if not _per_head(config):
        return w
    heads = config.n_head
    d = w.shape[0] // (3 * heads)
    return w.reshape(3, heads, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


# HF name inside transformer.h.{i} -> ours inside transformer.layers.{i}
_LAYER_NAMES = {"ln_1": "norm1", "ln_2": "norm2", "attn.c_proj": "mixer.out_proj", "mlp.c_fc": "mlp.fc1",
                "mlp.c_proj": "mlp.fc2"}


def remap_state_dict_hf_bigcode(state_dict, config):
    """HF GPTBigCodeForCausalLM state dict -> GPTLMHeadModel state dict (config: the converted GPT2Config).

    The word embedding (and an untied head) is padded to pad_vocab_size_multiple rows; unknown keys raise
    KeyError.
    """
    state_dict = OrderedDict(state_dict)
    out = OrderedDict()
    _remap_embeddings_and_head(state_dict, out, config, "transformer.wte.weight", tie_default=True)
    out["transformer.embeddings.position_embeddings.weight"] = state_dict.pop("transformer.wpe.weight")
    for kind in ("weight", "bias"):
        out[f"transformer.ln_f.{kind}"] = state_dict.pop(f"transformer.ln_f.{kind}")
    for layer in range(config.n_layer):
        src, dst = f"transformer.h.{layer}.", f"transformer.layers.{layer}."
        for kind in ("weight", "bias"):
            qkv = state_dict.pop(f"{src}attn.c_attn.{kind}", None)
            if qkv is not None:
                out[f"{dst}mixer.Wqkv.{kind}"] = _qkv_to_ours(qkv, config)
            _move_params(state_dict, out, src, dst, _LAYER_NAMES, kind)
    if state_dict:
        raise KeyError(f"unexpected keys in GPTBigCode state dict: {sorted(state_dict)[:5]}")
    return out


def inv_remap_state_dict_hf_bigcode(state_dict, config):
    """GPTLMHeadModel state dict -> HF GPTBigCodeForCausalLM state dict (inverse of remap_state_dict_hf_bigcode;
    padded vocabulary rows are dropped; ``lm_head.weight`` is included, as GPTBigCodeForCausalLM.state_dict()
    has it even when tied)."""
    state_dict = OrderedDict(state_dict)
    out = OrderedDict()
    _inv_remap_embeddings_and_head(state_dict, out, config, "transformer.wte.weight", keep_tied=True)
    out["transformer.wpe.weight"] = state_dict.pop("transformer.embeddings.position_embeddings.weight")
    for kind in ("weight", "bias"):
        out[f"transformer.ln_f.{kind}"] = state_dict.pop(f"transformer.ln_f.{kind}")
    inv_names = {ours: hf for hf, ours in _LAYER_NAMES.items()}
    for layer in range(config.n_layer):
        src, dst = f"transformer.layers.{layer}.", f"transformer.h.{layer}."
        for kind in ("weight", "bias"):
            wqkv = state_dict.pop(f"{src}mixer.Wqkv.{kind}", None)
            if wqkv is not None:
                out[f"{dst}attn.c_attn.{kind}"] = _qkv_to_bigcode(wqkv, config)
            _move_params(state_dict, out, src, dst, inv_names, kind)
    if state_dict:
        raise KeyError(f"unexpected keys in GPTLMHeadModel state dict: {sorted(state_dict)[:5]}")
    return out
