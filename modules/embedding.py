"""Token + position embeddings for GPT-2-style and BERT-style models.

Parameter names (``word_embeddings``, ``position_embeddings``, ``token_type_embeddings``,
``project_in``) match FlashAttention 2's ``flash_attn.modules.embedding`` so its state-dict remaps apply.
"""
import torch
from torch import nn


def _positions(input_ids, position_ids):
    if position_ids is not None:
        return position_ids
    seqlen = input_ids.shape[1]
    return torch.arange(seqlen, dtype=torch.long, device=input_ids.device)


class GPT2Embeddings(nn.Module):
    """Word embeddings plus (optional) learned absolute position embeddings.

    Args:
        embed_dim: model width D.
        vocab_size: number of token ids.
        max_position_embeddings: number of learned positions; 0 disables them (e.g. rotary models).
        padding_idx: passed to ``nn.Embedding``.
        word_embed_proj_dim: if set, tokens embed to this width and a bias-free ``project_in``
            maps them to ``embed_dim`` (OPT-350m style).
    """

    def __init__(self, embed_dim, vocab_size, max_position_embeddings, padding_idx=None,
                 word_embed_proj_dim=None, device=None, dtype=None):
        super().__init__()
        if max_position_embeddings < 0:
            raise ValueError(f"max_position_embeddings must be >= 0, got {max_position_embeddings}")
        factory_kwargs = {"device": device, "dtype": dtype}
        if word_embed_proj_dim is None:
            self.word_embeddings = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx,
                                                **factory_kwargs)
            self.project_in = None
        else:
            self.word_embeddings = nn.Embedding(vocab_size, word_embed_proj_dim, padding_idx=padding_idx,
                                                **factory_kwargs)
            self.project_in = nn.Linear(word_embed_proj_dim, embed_dim, bias=False, **factory_kwargs)
        self.max_position_embeddings = max_position_embeddings
        if max_position_embeddings > 0:
            self.position_embeddings = nn.Embedding(max_position_embeddings, embed_dim, **factory_kwargs)

    def forward(self, input_ids, position_ids=None):
        """input_ids: (B, S) long; position_ids: (B, S) or (S,) long, default 0..S-1 -> (B, S, D)."""
        embeddings = self.word_embeddings(input_ids)
        if self.project_in is not None:
            embeddings = self.project_in(embeddings)
        if self.max_position_embeddings > 0:
            embeddings = embeddings + self.position_embeddings(_positions(input_ids, position_ids))
        return embeddings


class BertEmbeddings(nn.Module):
    """Word + learned position + token-type embeddings (the LayerNorm lives in the model, as ``emb_ln``).

    Args:
        embed_dim: model width D.
        vocab_size: number of token ids.
        max_position_embeddings: number of learned positions; 0 disables them.
        type_vocab_size: number of segment ids; 0 disables token-type embeddings.
        padding_idx: passed to the word embedding.
    """

    def __init__(self, embed_dim, vocab_size, max_position_embeddings, type_vocab_size, padding_idx=None,
                 device=None, dtype=None):
        super().__init__()
        if max_position_embeddings < 0 or type_vocab_size < 0:
            raise ValueError("max_position_embeddings and type_vocab_size must be >= 0, got "
                             f"{max_position_embeddings} and {type_vocab_size}")
        factory_kwargs = {"device": device, "dtype": dtype}
        self.word_embeddings = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx, **factory_kwargs)
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        if max_position_embeddings > 0:
            self.position_embeddings = nn.Embedding(max_position_embeddings, embed_dim, **factory_kwargs)
        if type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(type_vocab_size, embed_dim, **factory_kwargs)

    def forward(self, input_ids, position_ids=None, token_type_ids=None):
        """input_ids, position_ids, token_type_ids: (B, S) long (the last two optional) -> (B, S, D)."""
        embeddings = self.word_embeddings(input_ids)
        if self.max_position_embeddings > 0:
            embeddings = embeddings + self.position_embeddings(_positions(input_ids, position_ids))
        if self.type_vocab_size > 0:
            if token_type_ids is None:
                # Segment 0 for every token: one embedding row broadcast over (B, S).
                embeddings = embeddings + self.token_type_embeddings.weight[0]
            else:
                embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        return embeddings
