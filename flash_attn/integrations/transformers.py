"""Run ``transformers`` models on these kernels: an attention implementation for HF's ``AttentionInterface``.

    from flash_attn.integrations.transformers import register
    register()  # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fa_dropin")

Any model whose attention goes through ``ALL_ATTENTION_FUNCTIONS`` (LLaMA, Mistral, Qwen, Gemma, GPT-2, BERT,
... in recent transformers) then calls :func:`attention_forward`. Padding is handled the FlashAttention way:
the mask function registered alongside (HF's own flash-attention mask: the 2D padding mask, or None when
nothing is padded) lets this function unpad q/k/v, run the varlen kernel and pad the output back, instead
of materialising a 4D mask. Packed sequences (batch 1, ``position_ids`` restarting at 0, or HF's
``cu_seq_lens_q/k`` kwargs) run as separate sequences through the varlen kernel.

The name avoids "flash": transformers treats names containing it as its own FlashAttention integrations.
"""
import torch

ATTN_IMPLEMENTATION = "fa_dropin"


def _packed_cu_seqlens(position_ids):
    """cu_seqlens int32 and max length of the sequences packed in position_ids (1, S), or None if not packed."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    pos = position_ids[0]
    if pos.numel() < 2 or bool((pos[1:] - pos[:-1] == 1).all()):
        return None
    starts = torch.nonzero(pos == 0, as_tuple=False).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        return None
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                      softcap=None, is_causal=None, **kwargs):
    """HF attention-function contract.

    query (B, H, Sq, D), key/value (B, Hk, Sk, D) (GQA: H % Hk == 0); attention_mask: None or the 2D padding
    mask (B, Sk) (bool / 0-1, True = real token) produced by the registered mask function. sliding_window:
    each query sees itself and the sliding_window - 1 keys before it. Returns (out (B, Sq, H, Dv), None).
    """
    from flash_attn import flash_attn_func, flash_attn_varlen_func
    from flash_attn.bert_padding import pad_input, unpad_input

    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by the fa_dropin attention")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(
            f"fa_dropin attention got a {attention_mask.dim()}D attention mask; it takes the 2D padding mask "
            "that its registered mask function produces (transformers >= 4.53) or None")
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, S, H, D)
    batch, seqlen_q = q.shape[:2]
    seqlen_k = k.shape[1]
    window = (-1, -1)
    if sliding_window is not None and seqlen_k > sliding_window:
        window = (sliding_window - 1, sliding_window - 1)
    common = dict(dropout_p=dropout, softmax_scale=scaling, causal=causal, window_size=window,
                  softcap=softcap if softcap is not None else 0.0)

    if attention_mask is not None:
        key_mask = attention_mask.bool()
        query_mask = key_mask[:, -seqlen_q:]  # queries are the last Sq tokens of each sequence
        q_unpad, indices_q, cu_q, max_q, _ = unpad_input(q, query_mask)
        k_unpad, _, cu_k, max_k, _ = unpad_input(k, key_mask)
        v_unpad = unpad_input(v, key_mask)[0]
        out = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, **common)
        return pad_input(out, indices_q, batch, seqlen_q), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        max_q = int(max_q) if max_q is not None else int((cu_q[1:] - cu_q[:-1]).max())
        max_k = int(max_k) if max_k is not None else int((cu_k[1:] - cu_k[:-1]).max())
    elif seqlen_q == seqlen_k and (packed := _packed_cu_seqlens(kwargs.get("position_ids"))) is not None:
        cu_q, max_q = packed
        cu_k, max_k = cu_q, max_q
    else:
        return flash_attn_func(q, k, v, **common), None
    if batch != 1:
        raise ValueError(f"packed sequences need batch size 1, got {batch}")
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, max_q, max_k, **common)
    return out.unsqueeze(0), None


def register(name=ATTN_IMPLEMENTATION):
    """Register :func:`attention_forward` (and its mask function) with transformers under ``name``; returns
    the name, to pass as ``attn_implementation=``."""
    if not isinstance(name, str) or not name or "flash" in name:
        raise ValueError(f"name must be a non-empty string without 'flash' (transformers reserves those), "
                         f"got {name!r}")
    try:
        from transformers import AttentionInterface
    except ImportError as e:
        raise ImportError("flash_attn.integrations.transformers needs transformers >= 4.48 (AttentionInterface)") from e
    AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError:
        # Older transformers build a 4D mask for custom attention when there is padding; attention_forward
        # rejects it with a clear error rather than silently ignoring the padding.
        return name
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
