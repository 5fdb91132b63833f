"""BERT (Devlin et al. 2019) encoder and pre-training heads, built from the shared post-norm blocks.

Padding never reaches the attention kernels: with ``use_flash_attn`` the encoder removes the padded tokens
once (unpad), runs every layer on the packed (total_tokens, D) batch through the varlen kernels and puts
the padding back at the end. For masked-LM pre-training the last layer can compute only the tokens that
are predicted (``last_layer_subset``: queries = masked tokens + [CLS], keys = all tokens), and the
prediction head can run on those tokens only (``dense_seq_output``).

Config: a ``transformers.BertConfig`` plus the optional fields FlashAttention 2 reads: use_flash_attn,
fused_bias_fc, fused_mlp, fused_dropout_add_ln, last_layer_subset, dense_seq_output, pad_vocab_size_multiple.
Parameter names match FA2's ``flash_attn.models.bert`` (``bert.encoder.layers.{i}.mixer.Wqkv``, ``bert.emb_ln``,
``cls.predictions.transform.layer_norm``, ...), so ``remap_state_dict`` output loads FA2 checkpoints too.
"""
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input
from flash_attn.modules.block import Block
from flash_attn.modules.embedding import BertEmbeddings
from flash_attn.modules.mha import MHA
from flash_attn.modules.mlp import FusedMLP, Mlp

# --------------------------------------------------------------------------------------------- config
_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_fast": partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}
_FUSED_NAMES = {"gelu": "gelu", "gelu_new": "gelu_approx", "gelu_fast": "gelu_approx",
                "gelu_pytorch_tanh": "gelu_approx", "relu": "relu"}


def _get(config, name, default):
    value = getattr(config, name, default)
    return default if value is None else value


def _padded_vocab(config):
    multiple = _get(config, "pad_vocab_size_multiple", 1)
    return math.ceil(config.vocab_size / multiple) * multiple


def _activation(config):
    act = config.hidden_act
    if act not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {act!r} is not supported; expected one of {sorted(_ACTIVATIONS)}")
    return act


def create_mixer_cls(config, cross_attn=False):
    return partial(MHA, num_heads=config.num_attention_heads, cross_attn=cross_attn,
                   dropout=config.attention_probs_dropout_prob, causal=False,
                   fused_bias_fc=_get(config, "fused_bias_fc", False),
                   use_flash_attn=_get(config, "use_flash_attn", False))


def create_mlp_cls(config, layer_idx=None):
    act = _activation(config)
    if _get(config, "fused_mlp", False):
        return partial(FusedMLP, hidden_features=config.intermediate_size, activation=_FUSED_NAMES[act])
    return partial(Mlp, hidden_features=config.intermediate_size, activation=_ACTIVATIONS[act])


def create_block(config, layer_idx=None):
    """Post-norm layer; the last one is a cross-attention layer (Wq / Wkv) when config.last_layer_subset."""
    last_layer_subset = _get(config, "last_layer_subset", False)
    cross_attn = last_layer_subset and layer_idx == config.num_hidden_layers - 1
    return Block(config.hidden_size, create_mixer_cls(config, cross_attn), create_mlp_cls(config, layer_idx),
                 norm_cls=partial(nn.LayerNorm, eps=config.layer_norm_eps), prenorm=False,
                 resid_dropout1=config.hidden_dropout_prob, resid_dropout2=config.hidden_dropout_prob,
                 fused_dropout_add_ln=_get(config, "fused_dropout_add_ln", False))


def _init_weights(module, initializer_range=0.02):
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=initializer_range)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=initializer_range)
        if module.padding_idx is not None:
            nn.init.zeros_(module.weight[module.padding_idx])


# --------------------------------------------------------------------------------------------- encoder
class BertEncoder(nn.Module):
    """num_hidden_layers post-norm blocks.

    forward(hidden_states (B, S, D), key_padding_mask (B, S) bool or None, subset_mask (B, S) bool or None):
    (B, S, D), or (num_subset_tokens, D) in row-major order of subset_mask when it is given.
    """

    def __init__(self, config):
        super().__init__()
        self.use_flash_attn = _get(config, "use_flash_attn", False)
        self.layers = nn.ModuleList([create_block(config, layer_idx=i) for i in range(config.num_hidden_layers)])

    def forward(self, hidden_states, key_padding_mask=None, subset_mask=None):
        if key_padding_mask is None or not self.use_flash_attn:
            mixer_kwargs = {"key_padding_mask": key_padding_mask} if key_padding_mask is not None else None
            for layer in self.layers:
                hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
            return hidden_states if subset_mask is None else hidden_states[subset_mask]
        batch, seqlen = hidden_states.shape[:2]
        hidden_states, indices, cu_seqlens, max_seqlen, _ = unpad_input(hidden_states, key_padding_mask)
        mixer_kwargs = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}  # (total, D) from here on
        if subset_mask is None:
            for layer in self.layers:
                hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
            return pad_input(hidden_states, indices, batch, seqlen)
        for layer in self.layers[:-1]:
            hidden_states = layer(hidden_states, mixer_kwargs=mixer_kwargs)
        subset_idx = torch.nonzero(subset_mask[key_padding_mask], as_tuple=False).flatten()
        subset_seqlens = (subset_mask & key_padding_mask).sum(dim=-1, dtype=torch.int32)
        subset_cu_seqlens = F.pad(torch.cumsum(subset_seqlens, dim=0, dtype=torch.int32), (1, 0))
        last = self.layers[-1]
        if not last.mixer.cross_attn:
            return last(hidden_states, mixer_kwargs=mixer_kwargs)[subset_idx]
        # Last layer: queries are the subset tokens only, keys/values every token of their sequence.
        return last(index_first_axis(hidden_states, subset_idx),
                    mixer_kwargs={"x_kv": hidden_states, "cu_seqlens": subset_cu_seqlens,
                                  "max_seqlen": int(subset_seqlens.max()), "cu_seqlens_k": cu_seqlens,
                                  "max_seqlen_k": max_seqlen})


class BertPooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states, pool=True):
        """(B, S, D) -> tanh(dense(first token)) (B, D); pool=False takes (B, D) first tokens directly."""
        first = hidden_states[:, 0] if pool else hidden_states
        return self.activation(self.dense(first))


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = _ACTIVATIONS[_activation(config)]
        self.layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        return self.layer_norm(self.transform_act_fn(self.dense(hidden_states)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, _padded_vocab(config), bias=True)

    def forward(self, hidden_states):
        return self.decoder(self.transform(hidden_states))


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, sequence_output, pooled_output):
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


# --------------------------------------------------------------------------------------------- models
@dataclass
class BertModelOutput:
    """last_hidden_state (B, S, D) (or (num_masked, D) with masked_tokens_mask); pooler_output (B, D)."""

    last_hidden_state: torch.Tensor
    pooler_output: Optional[torch.Tensor] = None


@dataclass
class BertForPreTrainingOutput:
    """loss () fp32 when labels and next_sentence_label are given; prediction_logits (B, S, V) or
    (num_masked, V) with dense_seq_output; seq_relationship_logits (B, 2)."""

    loss: Optional[torch.Tensor]
    prediction_logits: torch.Tensor
    seq_relationship_logits: torch.Tensor


class BertPreTrainedModel(nn.Module):
    def __init__(self, config, *inputs, **kwargs):
        super().__init__()
        for field in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
            if not hasattr(config, field):
                raise TypeError(f"config must be a BertConfig-like object with {field!r}; got {type(config).__name__}")
        if getattr(config, "position_embedding_type", "absolute") not in (None, "absolute"):
            raise NotImplementedError(f"position_embedding_type {config.position_embedding_type!r}: only "
                                      "'absolute' is supported")
        self.config = config


class BertModel(BertPreTrainedModel):
    """Embeddings -> LayerNorm -> dropout -> encoder -> pooler.

    forward(input_ids (B, S), position_ids=None, token_type_ids=None, attention_mask (B, S) 1 = real token,
    masked_tokens_mask (B, S) bool: return only those tokens' states, computing only them in the last layer
    when config.last_layer_subset) -> BertModelOutput.
    """

    def __init__(self, config, add_pooling_layer=True):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config.hidden_size, _padded_vocab(config), config.max_position_embeddings,
                                         config.type_vocab_size, padding_idx=config.pad_token_id)
        self.emb_drop = nn.Dropout(config.hidden_dropout_prob)
        self.emb_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.apply(partial(_init_weights, initializer_range=config.initializer_range))

    def forward(self, input_ids, position_ids=None, token_type_ids=None, attention_mask=None,
                masked_tokens_mask=None):
        hidden_states = self.embeddings(input_ids, position_ids=position_ids, token_type_ids=token_type_ids)
        hidden_states = self.emb_drop(self.emb_ln(hidden_states))
        key_padding_mask = attention_mask.bool() if attention_mask is not None else None
        subset_mask = None
        if masked_tokens_mask is not None:
            first_col = torch.zeros_like(masked_tokens_mask, dtype=torch.bool)
            first_col[:, 0] = True  # the pooler reads the first ([CLS]) token
            subset_mask = masked_tokens_mask.bool() | first_col
        sequence_output = self.encoder(hidden_states, key_padding_mask=key_padding_mask, subset_mask=subset_mask)
        if masked_tokens_mask is None:
            pooled = self.pooler(sequence_output) if self.pooler is not None else None
            return BertModelOutput(last_hidden_state=sequence_output, pooler_output=pooled)
        # sequence_output holds the subset tokens in row-major order; pick out [CLS] and the masked ones.
        pooled = (self.pooler(sequence_output[first_col[subset_mask]], pool=False)
                  if self.pooler is not None else None)
        return BertModelOutput(last_hidden_state=sequence_output[masked_tokens_mask.bool()[subset_mask]],
                               pooler_output=pooled)


class BertForPreTraining(BertPreTrainedModel):
    """BertModel + masked-LM and next-sentence heads (decoder tied to the word embeddings).

    forward(input_ids, position_ids=None, token_type_ids=None, attention_mask=None, labels (B, S) with 0 for
    unmasked tokens (FA2's convention), next_sentence_label (B,)) -> BertForPreTrainingOutput.
    """

    def __init__(self, config):
        super().__init__(config)
        self.dense_seq_output = _get(config, "dense_seq_output", False)
        self.last_layer_subset = _get(config, "last_layer_subset", False)
        if self.last_layer_subset and not self.dense_seq_output:
            raise ValueError("last_layer_subset requires dense_seq_output")
        from flash_attn.losses.cross_entropy import CrossEntropyLoss

        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.mlm_loss = CrossEntropyLoss(ignore_index=0)
        self.nsp_loss = CrossEntropyLoss(ignore_index=-1)
        self.apply(partial(_init_weights, initializer_range=config.initializer_range))
        self.tie_weights()

    def tie_weights(self):
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids, position_ids=None, token_type_ids=None, attention_mask=None, labels=None,
                next_sentence_label=None):
        masked_tokens_mask = labels > 0 if (self.last_layer_subset and labels is not None) else None
        outputs = self.bert(input_ids, position_ids=position_ids, token_type_ids=token_type_ids,
                            attention_mask=attention_mask, masked_tokens_mask=masked_tokens_mask)
        sequence_output, pooled_output = outputs.last_hidden_state, outputs.pooler_output
        masked_idx = None
        if self.dense_seq_output and labels is not None:
            masked_idx = torch.nonzero(labels.flatten() > 0, as_tuple=False).flatten()
            if not self.last_layer_subset:
                sequence_output = index_first_axis(sequence_output.flatten(0, 1), masked_idx)  # (num_masked, D)
        prediction_scores, seq_relationship_score = self.cls(sequence_output, pooled_output)
        total_loss = None
        if labels is not None and next_sentence_label is not None:
            if masked_idx is not None:
                mlm = self.mlm_loss(prediction_scores, labels.flatten()[masked_idx])
            else:
                mlm = self.mlm_loss(prediction_scores.flatten(0, -2), labels.flatten())
            nsp = self.nsp_loss(seq_relationship_score.flatten(0, -2), next_sentence_label.flatten())
            total_loss = mlm.float() + nsp.float()
        return BertForPreTrainingOutput(loss=total_loss, prediction_logits=prediction_scores,
                                        seq_relationship_logits=seq_relationship_score)


# --------------------------------------------------------------------------------------------- checkpoints
def remap_state_dict(state_dict, config):
    """HF BertForPreTraining (or BertModel, keys without "bert.") state dict -> BertForPreTraining state dict.

    q, k, v are concatenated into Wqkv (into Wq and Wkv for the last layer when config.last_layer_subset);
    vocabulary rows are padded to pad_vocab_size_multiple; old checkpoints' LayerNorm gamma/beta are renamed.
    """
    state_dict = OrderedDict(state_dict)
    if not any(k.startswith("bert.") for k in state_dict):
        state_dict = OrderedDict(("bert." + k, v) for k, v in state_dict.items())
    state_dict = OrderedDict((re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", re.sub(r"LayerNorm\.beta$",
                                                                                       "LayerNorm.bias", k)), v)
                             for k, v in state_dict.items())
    state_dict.pop("bert.embeddings.position_ids", None)
    state_dict.pop("bert.embeddings.token_type_ids", None)
    vocab = _padded_vocab(config)
    last_layer_subset = _get(config, "last_layer_subset", False)
    out = OrderedDict()

    def pad_vocab(t):
        return F.pad(t, (0, 0, 0, vocab - t.shape[0]) if t.dim() == 2 else (0, vocab - t.shape[0]))

    names = {"attention.output.dense": "mixer.out_proj", "attention.output.LayerNorm": "norm1",
             "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2", "output.LayerNorm": "norm2"}
    for layer in range(config.num_hidden_layers):
        src, dst = f"bert.encoder.layer.{layer}.", f"bert.encoder.layers.{layer}."
        for kind in ("weight", "bias"):
            q, k, v = (state_dict.pop(f"{src}attention.self.{n}.{kind}") for n in ("query", "key", "value"))
            if last_layer_subset and layer == config.num_hidden_layers - 1:
                out[f"{dst}mixer.Wq.{kind}"] = q
                out[f"{dst}mixer.Wkv.{kind}"] = torch.cat([k, v], dim=0)
            else:
                out[f"{dst}mixer.Wqkv.{kind}"] = torch.cat([q, k, v], dim=0)
            for hf_name, our_name in names.items():
                out[f"{dst}{our_name}.{kind}"] = state_dict.pop(f"{src}{hf_name}.{kind}")
    for key, value in state_dict.items():
        new = key
        new = re.sub(r"^bert\.embeddings\.LayerNorm\.", "bert.emb_ln.", new)
        new = re.sub(r"^cls\.predictions\.transform\.LayerNorm\.", "cls.predictions.transform.layer_norm.", new)
        if re.match(r"^bert\.encoder\.layer\.", new):
            raise KeyError(f"unexpected key in BERT state dict: {key!r}")
        out[new] = value
    if "bert.embeddings.word_embeddings.weight" in out:
        out["bert.embeddings.word_embeddings.weight"] = pad_vocab(out["bert.embeddings.word_embeddings.weight"])
    # HF stores the decoder bias twice (cls.predictions.bias and its alias decoder.bias).
    bias = out.pop("cls.predictions.bias", None)
    bias = out.get("cls.predictions.decoder.bias", bias)
    if bias is not None:
        out["cls.predictions.decoder.bias"] = pad_vocab(bias)
    if "cls.predictions.decoder.weight" in out:
        out["cls.predictions.decoder.weight"] = pad_vocab(out["cls.predictions.decoder.weight"])
    elif "bert.embeddings.word_embeddings.weight" in out and "cls.predictions.decoder.bias" in out:
        out["cls.predictions.decoder.weight"] = out["bert.embeddings.word_embeddings.weight"]
    return out
