"""GPT-NeoX (Black et al. 2022; Pythia) as a ``GPTLMHeadModel``: config conversion and HF checkpoint remapping.

A GPT-NeoX layer is a pre-norm layer with LayerNorm (with bias), rotary attention on the first
``rotary_pct * head_dim`` dims of each head (rotate-half pairs (i, i + r/2), i.e. *non-interleaved*), biased
projections and a plain GELU MLP. With ``use_parallel_residual`` (the default) attention and MLP read the same
residual through two LayerNorms and both add to it: :class:`flash_attn.modules.block.ParallelBlock` with
untied norms (``parallel_block=True``). Otherwise it is an ordinary pre-norm ``Block``. The LM head
(``embed_out``, ``lm_head`` in recent transformers) is untied and has no bias.

Weight layout: HF's fused ``query_key_value`` projection is grouped per head, its output rows ordered
(head, {q, k, v}, head_dim); ``mixer.Wqkv`` wants ({q, k, v}, head, head_dim). The remap permutes the rows.
"""
from collections import OrderedDict

from transformers import GPT2Config

from flash_attn.models.gpt import (_inv_remap_embeddings_and_head, _move_params, _remap_embeddings_and_head,
                                   rope_inv_freq)


def _rope(neox_config):
    """(theta, rotary fraction, scaling dict or None) from an HF GPTNeoXConfig (rope_parameters, or the old
    rotary_emb_base / rotary_pct / rope_scaling attributes)."""
    params = getattr(neox_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(neox_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(neox_config, "rotary_emb_base", 10000.0))
        params.setdefault("partial_rotary_factor", getattr(neox_config, "rotary_pct", 0.25))
    theta = float(params.get("rope_theta", 10000.0))
    fraction = float(params.get("partial_rotary_factor", 1.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, fraction, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    rope_inv_freq(2, theta, scaling)  # raises NotImplementedError for unsupported types (dynamic, yarn, ...)
    return theta, fraction, scaling


def gpt_neox_config_to_gpt2_config(gpt_neox_config):
    """HF GPTNeoXConfig -> GPT2Config for GPTLMHeadModel (parallel or sequential residual, partial rotary)."""
    c = gpt_neox_config
    hidden, heads = c.hidden_size, c.num_attention_heads
    if hidden % heads != 0:
        raise ValueError(f"hidden_size ({hidden}) must be divisible by num_attention_heads ({heads})")
    theta, fraction, scaling = _rope(c)
    attention_bias = bool(getattr(c, "attention_bias", True))
    hidden_dropout = float(getattr(c, "hidden_dropout", 0.0) or 0.0)
    return GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=0,  # positions come from rotary embeddings only
        n_embd=hidden,
        n_layer=c.num_hidden_layers,
        n_head=heads,
        n_inner=c.intermediate_size,
        activation_function=c.hidden_act,
        resid_pdrop=hidden_dropout,
        embd_pdrop=hidden_dropout,
        attn_pdrop=float(getattr(c, "attention_dropout", 0.0) or 0.0),
        layer_norm_epsilon=c.layer_norm_eps,
        initializer_range=c.initializer_range,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=getattr(c, "pad_token_id", None),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        # The fields below are read by flash_attn.models.gpt.
        rotary_emb_fraction=fraction,
        rotary_emb_base=theta,
        rotary_emb_scaling=scaling,
        rotary_emb_interleaved=False,
        parallel_block=bool(getattr(c, "use_parallel_residual", True)),
        parallel_block_tied_norm=False,
        qkv_proj_bias=attention_bias,
        out_proj_bias=attention_bias,
        mlp_fc1_bias=True,
        mlp_fc2_bias=True,
        lm_head_bias=False,
    )


def _per_head_to_grouped(w, nheads):
    """Rows (head, 3, head_dim) -> (3, head, head_dim); works for weights (rows, in) and biases (rows,)."""
    d = w.shape[0] // (3 * nheads)
    return w.reshape(nheads, 3, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def _grouped_to_per_head(w, nheads):
    d = w.shape[0] // (3 * nheads)
    return w.reshape(3, nheads, d, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


_LAYER_NAMES = {  # HF name inside gpt_neox.layers.{i} -> ours inside transformer.layers.{i}
    "input_layernorm": "norm1",
    "post_attention_layernorm": "norm2",
    "attention.dense": "mixer.out_proj",
    "mlp.dense_h_to_4h": "mlp.fc1",
    "mlp.dense_4h_to_h": "mlp.fc2",
}
_INV_LAYER_NAMES = {ours: hf for hf, ours in _LAYER_NAMES.items()}


def remap_state_dict_hf_gpt_neox(state_dict, config):
    """HF GPTNeoXForCausalLM state dict -> GPTLMHeadModel state dict (config: the converted GPT2Config).

    Accepts the LM head as ``embed_out.weight`` (checkpoints) or ``lm_head.weight`` (recent transformers);
    rotary inv_freq / attention-mask buffers of old versions are dropped.
    """
    state_dict = OrderedDict(state_dict)
    out = OrderedDict()
    _remap_embeddings_and_head(state_dict, out, config, "gpt_neox.embed_in.weight",
                               head_keys=("embed_out.weight", "lm_head.weight"))
    for kind in ("weight", "bias"):
        out[f"transformer.ln_f.{kind}"] = state_dict.pop(f"gpt_neox.final_layer_norm.{kind}")
    for layer in range(config.n_layer):
        src, dst = f"gpt_neox.layers.{layer}.", f"transformer.layers.{layer}."
        for kind in ("weight", "bias"):
            qkv = state_dict.pop(f"{src}attention.query_key_value.{kind}", None)
            if qkv is not None:
                out[f"{dst}mixer.Wqkv.{kind}"] = _per_head_to_grouped(qkv, config.n_head)
            _move_params(state_dict, out, src, dst, _LAYER_NAMES, kind)
        for buffer in ("attention.rotary_emb.inv_freq", "attention.bias", "attention.masked_bias"):
            state_dict.pop(src + buffer, None)
    state_dict.pop("gpt_neox.rotary_emb.inv_freq", None)
    if state_dict:
        raise KeyError(f"unexpected keys in GPT-NeoX state dict: {sorted(state_dict)[:5]}")
    return out


def inv_remap_state_dict_hf_gpt_neox(state_dict, config, lm_head_name="embed_out"):
    """GPTLMHeadModel state dict -> HF GPT-NeoX state dict (inverse of remap_state_dict_hf_gpt_neox; padded
    vocabulary rows are dropped). lm_head_name: "embed_out" (checkpoint name) or "lm_head" (the module name
    of transformers >= 5)."""
    state_dict = OrderedDict(state_dict)
    out = OrderedDict()
    _inv_remap_embeddings_and_head(state_dict, out, config, "gpt_neox.embed_in.weight", f"{lm_head_name}.weight")
    for kind in ("weight", "bias"):
        out[f"gpt_neox.final_layer_norm.{kind}"] = state_dict.pop(f"transformer.ln_f.{kind}")
    for layer in range(config.n_layer):
        src, dst = f"transformer.layers.{layer}.", f"gpt_neox.layers.{layer}."
        for kind in ("weight", "bias"):
            wqkv = state_dict.pop(f"{src}mixer.Wqkv.{kind}", None)
            if wqkv is not None:
                out[f"{dst}attention.query_key_value.{kind}"] = _grouped_to_per_head(wqkv, config.n_head)
            _move_params(state_dict, out, src, dst, _INV_LAYER_NAMES, kind)
    if state_dict:
        raise KeyError(f"unexpected keys in GPTLMHeadModel state dict: {sorted(state_dict)[:5]}")
    return out
