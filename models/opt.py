"""OPT (Zhang et al. 2022) as a ``GPTLMHeadModel``: config conversion and HF checkpoint remapping.

An OPT layer (``do_layer_norm_before=True``, every size but 350m) is a pre-norm layer with LayerNorm, separate
biased q/k/v projections, a biased ReLU MLP and a final LayerNorm; the LM head is tied to the token
embedding. Positions are learned absolute embeddings whose table has two extra leading rows: HF looks up
``position + 2`` (row 1 serves left-padding tokens, row 0 is never read). The remap drops those two rows so
position p reads row p, as :class:`flash_attn.modules.embedding.GPT2Embeddings` does; the inverse puts two
zero rows back.

When ``word_embed_proj_dim != hidden_size`` tokens embed to the narrower width, a bias-free ``project_in``
maps them up and a bias-free ``project_out`` maps the final hidden state down before the LM head; both are
supported. Not expressible in ``flash_attn.models.gpt`` and refused by the config conversion with a
``NotImplementedError``: post-norm layers (``do_layer_norm_before=False``, e.g. OPT-350m), pre-norm without
the final LayerNorm (``_remove_final_layer_norm``) and LayerNorms without parameters
(``layer_norm_elementwise_affine=False``).

Weight layout: ``mixer.Wqkv`` is the row-wise concatenation of HF's q_proj, k_proj and v_proj.
"""
import re
from collections import OrderedDict

import torch
from transformers import GPT2Config

from flash_attn.models.gpt import _move_params, _remap_embeddings_and_head

POSITION_OFFSET = 2  # leading rows of HF's position table that positions 0.. do not read


def opt_config_to_gpt2_config(opt_config):
    """HF OPTConfig -> GPT2Config for GPTLMHeadModel. Raises NotImplementedError for OPT variants the
    pre-norm GPT model cannot express (see the module docstring)."""
    c = opt_config
    hidden, heads = c.hidden_size, c.num_attention_heads
    if hidden % heads != 0:
        raise ValueError(f"hidden_size ({hidden}) must be divisible by num_attention_heads ({heads})")
    if not getattr(c, "do_layer_norm_before", True):
        raise NotImplementedError("OPT with do_layer_norm_before=False (post-norm layers, e.g. OPT-350m) is not "
                                  "supported: flash_attn.models.gpt only builds pre-norm layers")
    if getattr(c, "_remove_final_layer_norm", False):
        raise NotImplementedError("OPT with _remove_final_layer_norm=True is not supported: GPTModel always "
                                  "applies a final LayerNorm")
    if not getattr(c, "layer_norm_elementwise_affine", True):
        raise NotImplementedError("OPT with layer_norm_elementwise_affine=False is not supported: GPTModel's "
                                  "LayerNorms always have weight and bias")
    proj_dim = getattr(c, "word_embed_proj_dim", None)
    bias = bool(getattr(c, "enable_bias", True))
    dropout = float(getattr(c, "dropout", 0.0) or 0.0)
    return GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.max_position_embeddings,
        n_embd=hidden,
        n_layer=c.num_hidden_layers,
        n_head=heads,
        n_inner=c.ffn_dim,
        activation_function=c.activation_function,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=float(getattr(c, "attention_dropout", 0.0) or 0.0),
        layer_norm_epsilon=1e-5,  # OPT's nn.LayerNorm default
        initializer_range=getattr(c, "init_std", 0.02),
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=getattr(c, "pad_token_id", None),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
        # The fields below are read by flash_attn.models.gpt.
        word_embed_proj_dim=proj_dim if proj_dim is not None and proj_dim != hidden else None,
        qkv_proj_bias=bias,
        out_proj_bias=bias,
        mlp_fc1_bias=bias,
        mlp_fc2_bias=bias,
        lm_head_bias=False,
    )


_LAYER_NAMES = {  # HF name inside decoder.layers.{i} -> ours inside transformer.layers.{i}
    "self_attn_layer_norm": "norm1",
    "final_layer_norm": "norm2",
    "self_attn.out_proj": "mixer.out_proj",
    "fc1": "mlp.fc1",
    "fc2": "mlp.fc2",
}
_INV_LAYER_NAMES = {ours: hf for hf, ours in _LAYER_NAMES.items()}


def remap_state_dict_hf_opt(state_dict, config):
    """HF OPTForCausalLM / OPTModel state dict -> GPTLMHeadModel state dict (config: the converted GPT2Config).

    Keys may carry the ``model.`` prefix of OPTForCausalLM or not (OPTModel); unknown keys raise KeyError.
    """
    state_dict = OrderedDict((re.sub(r"^model\.", "", k), v) for k, v in state_dict.items())
    out = OrderedDict()
    _remap_embeddings_and_head(state_dict, out, config, "decoder.embed_tokens.weight", tie_default=True)
    positions = state_dict.pop("decoder.embed_positions.weight")
    out["transformer.embeddings.position_embeddings.weight"] = positions[POSITION_OFFSET:]
    if getattr(config, "word_embed_proj_dim", None) is not None:
        out["transformer.embeddings.project_in.weight"] = state_dict.pop("decoder.project_in.weight")
        out["project_out.weight"] = state_dict.pop("decoder.project_out.weight")
    for kind in ("weight", "bias"):
        out[f"transformer.ln_f.{kind}"] = state_dict.pop(f"decoder.final_layer_norm.{kind}")
    for layer in range(config.n_layer):
        src, dst = f"decoder.layers.{layer}.", f"transformer.layers.{layer}."
        for kind in ("weight", "bias"):
            qkv = [state_dict.pop(f"{src}self_attn.{p}_proj.{kind}", None) for p in "qkv"]
            if any(t is not None for t in qkv):
                if any(t is None for t in qkv):
                    raise KeyError(f"{src}self_attn: q_proj, k_proj and v_proj {kind}s must all be present")
                out[f"{dst}mixer.Wqkv.{kind}"] = torch.cat(qkv, dim=0)
            _move_params(state_dict, out, src, dst, _LAYER_NAMES, kind)
    if state_dict:
        raise KeyError(f"unexpected keys in OPT state dict: {sorted(state_dict)[:5]}")
    return out


def inv_remap_state_dict_hf_opt(state_dict, config):
    """GPTLMHeadModel state dict -> HF OPTForCausalLM state dict (inverse of remap_state_dict_hf_opt; padded
    vocabulary rows are dropped, the two unread leading position rows come back as zeros, the tied
    ``lm_head.weight`` is included as OPTForCausalLM.state_dict() has it)."""
    state_dict = OrderedDict(state_dict)
    vocab = config.vocab_size
    out = OrderedDict()
    out["model.decoder.embed_tokens.weight"] = state_dict.pop("transformer.embeddings.word_embeddings.weight")[:vocab]
    positions = state_dict.pop("transformer.embeddings.position_embeddings.weight")
    out["model.decoder.embed_positions.weight"] = torch.cat(
        [positions.new_zeros(POSITION_OFFSET, positions.shape[1]), positions], dim=0)
    out["lm_head.weight"] = state_dict.pop("lm_head.weight")[:vocab]
    if getattr(config, "word_embed_proj_dim", None) is not None:
        out["model.decoder.project_in.weight"] = state_dict.pop("transformer.embeddings.project_in.weight")
        out["model.decoder.project_out.weight"] = state_dict.pop("project_out.weight")
    for kind in ("weight", "bias"):
        out[f"model.decoder.final_layer_norm.{kind}"] = state_dict.pop(f"transformer.ln_f.{kind}")
    for layer in range(config.n_layer):
        src, dst = f"transformer.layers.{layer}.", f"model.decoder.layers.{layer}."
        for kind in ("weight", "bias"):
            wqkv = state_dict.pop(f"{src}mixer.Wqkv.{kind}", None)
            if wqkv is not None:
                for p, t in zip("qkv", wqkv.chunk(3, dim=0)):
                    out[f"{dst}self_attn.{p}_proj.{kind}"] = t
            _move_params(state_dict, out, src, dst, _INV_LAYER_NAMES, kind)
    if state_dict:
        raise KeyError(f"unexpected keys in GPTLMHeadModel state dict: {sorted(state_dict)[:5]}")
    return out
