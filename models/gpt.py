"""GPT-style decoder-only language models (GPT-2, and through their config converters LLaMA and friends).

Reads top to bottom: config fields -> layer factories -> ``GPTModel`` / ``GPTLMHeadModel`` -> checkpoint
remapping. The config is a ``transformers.GPT2Config`` (any object with its attributes works) plus the extra
fields FlashAttention 2 reads, all optional (default in parentheses):

    n_head_kv (n_head)            grouped-query attention
    rotary_emb_fraction (0.0)     fraction of each head dim that is rotated (0 = learned positions only)
    rotary_emb_base (10000.0), rotary_emb_scale_base (None), rotary_emb_interleaved (False)
    rotary_emb_scaling (None)     HF-style rope scaling dict: {"rope_type": "linear"|"llama3", "factor": ...}
    use_alibi (False), window_size ((-1, -1))
    rms_norm (False)              RMSNorm instead of LayerNorm
    parallel_block (False), parallel_block_tied_norm (False)   GPT-J / GPT-NeoX layers
    residual_in_fp32 (False), prenorm (True)
    qkv_proj_bias, out_proj_bias, mlp_fc1_bias, mlp_fc2_bias (True), lm_head_bias (False)
    mlp_multiple_of (128)         GatedMlp hidden size rounding
    pad_vocab_size_multiple (1)   embedding rows padded up to a multiple (tensor-core friendly)
    norm_head (False)             logits from L2-normalized LM head rows (Baichuan 2)
    muP (Yang et al. 2022, "Tensor Programs V"; BTLM): mup_scale_qk_dot_by_d (False) scales attention scores by
        1 / head_dim instead of 1 / sqrt(head_dim); mup_embeddings_multiplier (1.0) multiplies the embeddings;
        mup_output_multiplier * mup_width_scale (1.0 each) multiplies the LM head's input; with mup_width_scale
        != 1 the model starts from muP's init (flash_attn.models.btlm.mup_init_)
    use_flash_attn, fused_bias_fc, fused_mlp, fused_dropout_add_ln (False), mlp_checkpoint_lvl (0)

Parameter names match FA2's ``flash_attn.models.gpt`` (``transformer.embeddings``, ``transformer.layers.{i}``
with ``mixer``/``mlp``/``norm1``/``norm2``, ``transformer.ln_f``, ``lm_head``), so FA2 checkpoints load as is.
"""
import math
import re
from collections import OrderedDict, namedtuple
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from flash_attn.modules.block import Block, ParallelBlock
from flash_attn.modules.embedding import GPT2Embeddings
from flash_attn.modules.mha import MHA
from flash_attn.modules.mlp import GatedMlp, Mlp
from flash_attn.ops.linear import Linear
from flash_attn.utils.generation import GenerationMixin

CausalLMOutput = namedtuple("CausalLMOutput", ["logits"])


# --------------------------------------------------------------------------------------------- config
def _get(config, name, default):
    value = getattr(config, name, default)
    return default if value is None else value


def _sqrelu(x):
    return F.relu(x).square()


# HF activation names -> elementwise function. gelu_new / gelu_fast / gelu_pytorch_tanh are all the tanh
# approximation of GELU (they differ only in how the formula is evaluated).
_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_fast": partial(F.gelu, approximate="tanh"),
    "gelu_approx": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "sqrelu": _sqrelu,
}
_GATED_ACTIVATIONS = {"glu": F.sigmoid, "swiglu": F.silu, "geglu": F.gelu}
# FusedMLP's activation names for the activations it fuses.
_FUSED_MLP_ACTIVATIONS = {"gelu_new": "gelu_approx", "gelu_fast": "gelu_approx", "gelu_approx": "gelu_approx",
                          "gelu_pytorch_tanh": "gelu_approx", "relu": "relu", "sqrelu": "sqrelu"}


def rope_inv_freq(dim, base, rope_scaling=None, device=None):
    """Rotary inverse frequencies (dim // 2,) fp32: base^(-2i/dim), adjusted by an HF-style rope_scaling dict.

    "linear" (position interpolation, Chen et al. 2023) divides every frequency by factor; "llama3" keeps
    high frequencies, divides low ones (wavelength > original_max_position_embeddings / low_freq_factor) by
    factor and interpolates smoothly in between.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context = float(rope_scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_context / low_freq_factor, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_context / low_freq_factor) & (wavelen >= old_context / high_freq_factor)
        return torch.where(medium, interpolated, out)
    raise NotImplementedError(f"rope_scaling type {rope_type!r}: supported are 'default', 'linear', 'llama3'")


def _scaled_rotary(mha, rope_scaling):
    """Swap mha.rotary_emb for one whose frequencies follow rope_scaling (same dim, base and layout)."""
    from flash_attn.layers.rotary import RotaryEmbedding

    class ScaledRotaryEmbedding(RotaryEmbedding):
        # _compute_inv_freq is also what the table refresh falls back to after a dtype cast, so overriding
        # it (rather than overwriting the buffer) keeps the scaling in every path.
        def _compute_inv_freq(self, device=None):
            return rope_inv_freq(self.dim, self.base, rope_scaling, device=device)

    old = mha.rotary_emb
    mha.rotary_emb = ScaledRotaryEmbedding(old.dim, base=old.base, interleaved=old.interleaved,
                                           scale_base=old.scale_base, pos_idx_in_fp32=old.pos_idx_in_fp32,
                                           device=old.inv_freq.device)
    return mha


def create_mixer_cls(config, layer_idx=None, device=None, dtype=None):
    """Attention constructor for layer layer_idx: dim -> MHA."""
    factory_kwargs = {"device": device, "dtype": dtype}
    head_dim = config.n_embd // config.n_head
    power = 1.0 if _get(config, "mup_scale_qk_dot_by_d", False) else 0.5
    softmax_scale = head_dim ** -power if _get(config, "scale_attn_weights", True) else 1.0
    if _get(config, "scale_attn_by_inverse_layer_idx", False):
        if layer_idx is None:
            raise ValueError("scale_attn_by_inverse_layer_idx needs layer_idx")
        softmax_scale /= float(layer_idx + 1)
    rotary_emb_dim = int(_get(config, "rotary_emb_fraction", 0.0) * head_dim)
    rotary_emb_base = _get(config, "rotary_emb_base", 10000.0)
    mixer_cls = partial(
        MHA, num_heads=config.n_head, num_heads_kv=_get(config, "n_head_kv", None),
        qkv_proj_bias=_get(config, "qkv_proj_bias", True), out_proj_bias=_get(config, "out_proj_bias", True),
        dropout=_get(config, "attn_pdrop", 0.0), softmax_scale=softmax_scale, causal=True, layer_idx=layer_idx,
        rotary_emb_dim=rotary_emb_dim, rotary_emb_base=rotary_emb_base,
        rotary_emb_scale_base=_get(config, "rotary_emb_scale_base", None),
        rotary_emb_interleaved=_get(config, "rotary_emb_interleaved", False),
        use_alibi=_get(config, "use_alibi", False), window_size=tuple(_get(config, "window_size", (-1, -1))),
        fused_bias_fc=_get(config, "fused_bias_fc", False), use_flash_attn=_get(config, "use_flash_attn", False),
        **factory_kwargs)
    rope_scaling = getattr(config, "rotary_emb_scaling", None)
    if rotary_emb_dim > 0 and rope_scaling is not None:
        rope_inv_freq(2, 1.0, rope_scaling)  # fail at build time on an unsupported scaling type
        return lambda dim: _scaled_rotary(mixer_cls(dim), rope_scaling)
    return mixer_cls


def create_mlp_cls(config, layer_idx=None, device=None, dtype=None):
    """MLP constructor: dim -> Mlp / GatedMlp / FusedMLP from config.activation_function."""
    factory_kwargs = {"device": device, "dtype": dtype}
    inner_dim = _get(config, "n_inner", 4 * config.n_embd)
    act = config.activation_function
    bias1, bias2 = _get(config, "mlp_fc1_bias", True), _get(config, "mlp_fc2_bias", True)
    if act in _GATED_ACTIVATIONS:
        return partial(GatedMlp, hidden_features=inner_dim, activation=_GATED_ACTIVATIONS[act], bias1=bias1,
                       bias2=bias2, multiple_of=_get(config, "mlp_multiple_of", 128), **factory_kwargs)
    if act not in _ACTIVATIONS:
        raise ValueError(f"activation_function {act!r} is not supported; expected one of "
                         f"{sorted(_ACTIVATIONS) + sorted(_GATED_ACTIVATIONS)}")
    if _get(config, "fused_mlp", False):
        from flash_attn.modules.mlp import FusedMLP

        if act not in _FUSED_MLP_ACTIVATIONS:
            raise ValueError(f"fused_mlp supports activations {sorted(_FUSED_MLP_ACTIVATIONS)}, got {act!r}")
        return partial(FusedMLP, hidden_features=inner_dim, activation=_FUSED_MLP_ACTIVATIONS[act], bias1=bias1,
                       bias2=bias2, checkpoint_lvl=_get(config, "mlp_checkpoint_lvl", 0), **factory_kwargs)
    return partial(Mlp, hidden_features=inner_dim, activation=_ACTIVATIONS[act], bias1=bias1, bias2=bias2,
                   **factory_kwargs)


def _norm_cls(config, device=None, dtype=None):
    eps = _get(config, "layer_norm_epsilon", 1e-5)
    if _get(config, "rms_norm", False):
        from flash_attn.ops.triton.layer_norm import RMSNorm

        return partial(RMSNorm, eps=eps, device=device, dtype=dtype)
    return partial(nn.LayerNorm, eps=eps, device=device, dtype=dtype)


def create_block(config, layer_idx=None, device=None, dtype=None):
    """Layer layer_idx of the model: a pre-norm Block or ParallelBlock."""
    mixer_cls = create_mixer_cls(config, layer_idx, device=device, dtype=dtype)
    mlp_cls = create_mlp_cls(config, layer_idx, device=device, dtype=dtype)
    norm_cls = _norm_cls(config, device=device, dtype=dtype)
    # The embedding dropout is the first block's residual dropout: the block adds it to the (empty) residual.
    resid_dropout1 = _get(config, "embd_pdrop", 0.0) if layer_idx == 0 else _get(config, "resid_pdrop", 0.0)
    common = dict(norm_cls=norm_cls, resid_dropout1=resid_dropout1, resid_dropout2=_get(config, "resid_pdrop", 0.0),
                  fused_dropout_add_ln=_get(config, "fused_dropout_add_ln", False),
                  residual_in_fp32=_get(config, "residual_in_fp32", False))
    if _get(config, "parallel_block", False):
        block = ParallelBlock(config.n_embd, mixer_cls, mlp_cls,
                              tied_norm=_get(config, "parallel_block_tied_norm", False), **common)
    else:
        block = Block(config.n_embd, mixer_cls, mlp_cls, prenorm=True, **common)
    block.layer_idx = layer_idx
    return block


def _init_weights(module, n_layer, initializer_range=0.02, rescale_prenorm_residual=True):
    """GPT-2 initialisation: N(0, initializer_range) weights, zero biases; the projections that write into
    the residual stream (out_proj, fc2) scaled by 1/sqrt(2 * n_layer) so its variance stays O(1) with depth."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=initializer_range)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
    if rescale_prenorm_residual:
        for child_name in ("out_proj", "fc2"):
            child = getattr(module, child_name, None)
            if isinstance(child, nn.Linear):
                nn.init.normal_(child.weight, std=initializer_range / math.sqrt(2 * n_layer))


def _maybe_mup_init(model, config):
    """A muP model (mup_width_scale != 1, e.g. BTLM) starts from muP's init, not GPT-2's: hidden matrices'
    std scales with sqrt(mup_width_scale) (see flash_attn.models.btlm.mup_init_). At width scale 1 both agree."""
    if _get(config, "mup_width_scale", 1.0) != 1.0:
        from flash_attn.models.btlm import mup_init_  # btlm imports this module

        mup_init_(model, config)


# --------------------------------------------------------------------------------------------- models
class GPTPreTrainedModel(nn.Module):
    """Holds the config; subclasses build the layers."""

    def __init__(self, config, *inputs, **kwargs):
        super().__init__()
        for field in ("n_embd", "n_head", "n_layer", "vocab_size", "activation_function"):
            if not hasattr(config, field):
                raise TypeError(f"config must be a GPT2Config-like object with {field!r}; got {type(config).__name__}")
        self.config = config


class GPTModel(GPTPreTrainedModel):
    """Embeddings -> n_layer pre-norm blocks -> final dropout-add-norm.

    forward(input_ids (B, S) long, position_ids (B, S) optional, inference_params optional) -> (B, S, D).
    """

    def __init__(self, config, process_group=None, device=None, dtype=None):
        super().__init__(config)
        if process_group is not None:
            raise NotImplementedError("process_group: tensor parallelism is not implemented")
        if not _get(config, "prenorm", True):
            raise NotImplementedError("GPTModel only builds pre-norm layers (config.prenorm=False)")
        factory_kwargs = {"device": device, "dtype": dtype}
        self.parallel_block = _get(config, "parallel_block", False)
        self.residual_in_fp32 = _get(config, "residual_in_fp32", False)
        self.fused_dropout_add_ln = _get(config, "fused_dropout_add_ln", False)
        self.embeddings_multiplier = _get(config, "mup_embeddings_multiplier", 1.0)
        multiple = _get(config, "pad_vocab_size_multiple", 1)
        vocab_size = math.ceil(config.vocab_size / multiple) * multiple
        self.embeddings = GPT2Embeddings(config.n_embd, vocab_size, _get(config, "n_positions", 0),
                                         word_embed_proj_dim=getattr(config, "word_embed_proj_dim", None),
                                         **factory_kwargs)
        self.layers = nn.ModuleList([create_block(config, layer_idx=i, **factory_kwargs)
                                     for i in range(config.n_layer)])
        self.drop_f = nn.Dropout(_get(config, "resid_pdrop", 0.0))
        self.ln_f = _norm_cls(config, **factory_kwargs)(config.n_embd)
        self.apply(partial(_init_weights, n_layer=config.n_layer,
                           initializer_range=_get(config, "initializer_range", 0.02)))
        _maybe_mup_init(self, config)

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return {i: layer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)
                for i, layer in enumerate(self.layers)}

    def forward(self, input_ids, position_ids=None, inference_params=None):
        hidden_states = self.embeddings(input_ids, position_ids=position_ids)  # (B, S, D)
        if self.embeddings_multiplier != 1.0:
            hidden_states = hidden_states * self.embeddings_multiplier
        hidden_states2 = None
        residual = None
        mixer_kwargs = {"inference_params": inference_params} if inference_params is not None else None
        for layer in self.layers:
            if self.parallel_block:
                hidden_states, hidden_states2, residual = layer(hidden_states, hidden_states2, residual,
                                                                mixer_kwargs=mixer_kwargs)
            else:
                hidden_states, residual = layer(hidden_states, residual, mixer_kwargs=mixer_kwargs)
        if self.fused_dropout_add_ln:
            from flash_attn.ops.triton.layer_norm import layer_norm_fn, RMSNorm

            return layer_norm_fn(hidden_states, self.ln_f.weight, self.ln_f.bias, residual=residual,
                                 x1=hidden_states2, eps=self.ln_f.eps,
                                 dropout_p=self.drop_f.p if self.training else 0.0, prenorm=False,
                                 is_rms_norm=isinstance(self.ln_f, RMSNorm))
        dropped = self.drop_f(hidden_states)
        if hidden_states2 is not None:
            dropped = dropped + self.drop_f(hidden_states2)
        residual = dropped + residual if residual is not None else dropped
        return self.ln_f(residual.to(dtype=self.ln_f.weight.dtype))


class GPTLMHeadModel(GPTPreTrainedModel, GenerationMixin):
    """GPTModel plus a (by default tied) LM head.

    forward(input_ids (B, S), position_ids=None, inference_params=None, num_last_tokens=0)
    -> CausalLMOutput(logits (B, S or num_last_tokens, padded vocab)).
    """

    def __init__(self, config, process_group=None, device=None, dtype=None):
        super().__init__(config)
        factory_kwargs = {"device": device, "dtype": dtype}
        self.transformer = GPTModel(config, process_group=process_group, **factory_kwargs)
        self.tie_word_embeddings = _get(config, "tie_word_embeddings", True)
        multiple = _get(config, "pad_vocab_size_multiple", 1)
        vocab_size = math.ceil(config.vocab_size / multiple) * multiple
        proj_dim = getattr(config, "word_embed_proj_dim", None)
        if proj_dim is not None:
            self.project_out = Linear(config.n_embd, proj_dim, bias=False, **factory_kwargs)
        else:
            self.project_out = None
        self.lm_head = Linear(proj_dim if proj_dim is not None else config.n_embd, vocab_size,
                                 bias=_get(config, "lm_head_bias", False), **factory_kwargs)
        self.output_scale = _get(config, "mup_output_multiplier", 1.0) * _get(config, "mup_width_scale", 1.0)
        self.norm_head = _get(config, "norm_head", False)
        self.apply(partial(_init_weights, n_layer=config.n_layer,
                           initializer_range=_get(config, "initializer_range", 0.02)))
        self.tie_weights()
        _maybe_mup_init(self, config)

    def tie_weights(self):
        if self.tie_word_embeddings:
            self.lm_head.weight = self.transformer.embeddings.word_embeddings.weight

    def allocate_inference_cache(self, batch_size, max_seqlen, dtype=None, **kwargs):
        return self.transformer.allocate_inference_cache(batch_size, max_seqlen, dtype=dtype, **kwargs)

    def forward(self, input_ids, position_ids=None, inference_params=None, num_last_tokens=0):
        if num_last_tokens < 0:
            raise ValueError(f"num_last_tokens must be >= 0, got {num_last_tokens}")
        hidden_states = self.transformer(input_ids, position_ids=position_ids, inference_params=inference_params)
        if num_last_tokens > 0:
            hidden_states = hidden_states[:, -num_last_tokens:]
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        if self.output_scale != 1.0:
            hidden_states = hidden_states * self.output_scale
        if self.norm_head:
            return CausalLMOutput(logits=F.linear(hidden_states, F.normalize(self.lm_head.weight, dim=-1),
                                                  self.lm_head.bias))
        return CausalLMOutput(logits=self.lm_head(hidden_states))


# --------------------------------------------------------------------------------------------- checkpoints
def _pad_rows(weight, multiple):
    rows = math.ceil(weight.shape[0] / multiple) * multiple
    return F.pad(weight, (0, 0, 0, rows - weight.shape[0]))


def _move_params(state_dict, out, src, dst, names, kind):
    """For each (a, b) in ``names`` (a dict), pop ``{src}{a}.{kind}`` from state_dict into ``out`` as
    ``{dst}{b}.{kind}`` where present: a layer's renamed parameters in an HF remap (or, with the names
    swapped, its inverse)."""
    for a, b in names.items():
        value = state_dict.pop(f"{src}{a}.{kind}", None)
        if value is not None:
            out[f"{dst}{b}.{kind}"] = value


def _inv_remap_embeddings_and_head(state_dict, out, config, embed_key, head_key="lm_head.weight",
                                   keep_tied=False):
    """The inverse of :func:`_remap_embeddings_and_head`: pop our word embedding and LM head into ``out`` as
    ``embed_key`` / ``head_key`` without the padded vocabulary rows; a tied head is left out unless
    ``keep_tied`` (HF models whose state_dict() lists it anyway)."""
    vocab = config.vocab_size
    out[embed_key] = state_dict.pop("transformer.embeddings.word_embeddings.weight")[:vocab]
    lm_head = state_dict.pop("lm_head.weight")[:vocab]
    if keep_tied or not getattr(config, "tie_word_embeddings", False):
        out[head_key] = lm_head


def _remap_embeddings_and_head(state_dict, out, config, embed_key, head_keys=("lm_head.weight",),
                               tie_default=False):
    """Pop the word embedding (``embed_key``) and LM head (the first of ``head_keys`` present) from an HF
    state dict into ``out`` under this project's names, both padded to pad_vocab_size_multiple rows; a
    tied head (config.tie_word_embeddings, default ``tie_default``) is the embedding itself."""
    multiple = _get(config, "pad_vocab_size_multiple", 1)
    embeddings = _pad_rows(state_dict.pop(embed_key), multiple)
    out["transformer.embeddings.word_embeddings.weight"] = embeddings
    heads = [state_dict.pop(key, None) for key in head_keys]
    lm_head = next((h for h in heads if h is not None), None)
    if _get(config, "tie_word_embeddings", tie_default):
        out["lm_head.weight"] = embeddings
    else:
        if lm_head is None:
            raise KeyError(f"config.tie_word_embeddings is False but the state dict has no {head_keys[0]}")
        out["lm_head.weight"] = _pad_rows(lm_head, multiple)


def remap_state_dict_hf_gpt2(state_dict, config):
    """HF GPT2Model / GPT2LMHeadModel state dict -> GPTLMHeadModel state dict.

    HF's Conv1D stores weights as (in, out); they are transposed to nn.Linear's (out, in). The word
    embedding is padded to pad_vocab_size_multiple rows; the causal-mask buffers are dropped.
    """
    state_dict = OrderedDict((re.sub(r"^transformer\.", "", k), v) for k, v in state_dict.items())
    out = OrderedDict()
    _remap_embeddings_and_head(state_dict, out, config, "wte.weight", tie_default=True)
    if "wpe.weight" in state_dict:
        out["transformer.embeddings.position_embeddings.weight"] = state_dict.pop("wpe.weight")
    names = {"ln_1": "norm1", "ln_2": "norm2", "attn.c_attn": "mixer.Wqkv", "attn.c_proj": "mixer.out_proj",
             "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    for key, value in state_dict.items():
        if key.startswith("ln_f."):
            out["transformer." + key] = value
            continue
        if re.match(r"^h\.\d+\.attn\.(bias|masked_bias)$", key):
            continue  # HF's causal-mask buffers
        match = re.match(r"^h\.(\d+)\.(.+)\.(weight|bias)$", key)
        if match is None:
            raise KeyError(f"unexpected key in GPT-2 state dict: {key!r}")
        layer, module, kind = match.groups()
        if module not in names:
            raise KeyError(f"unexpected key in GPT-2 state dict: {key!r}")
        if kind == "weight" and module != "ln_1" and module != "ln_2":
            value = value.t()  # Conv1D (in, out) -> Linear (out, in)
        out[f"transformer.layers.{layer}.{names[module]}.{kind}"] = value
    return out
