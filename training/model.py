"""Model construction for training: ModelConfig -> GPTLMHeadModel, and the numbers derived from it
(shape signature for checkpoints, matmul FLOPs per token for MFU)."""
import torch
from torch import nn

from flash_attn.training.config import ConfigError

# Fields that fix the parameter shapes: a checkpoint only loads into a model that agrees on all of them.
SHAPE_FIELDS = ("arch", "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_head_kv", "n_inner",
                "parallel_block", "tie_word_embeddings", "pad_vocab_size_multiple")


def _use_fused(mcfg, device):
    return mcfg.fused == "on" or (mcfg.fused == "auto" and torch.device(device).type == "cuda")


def gpt2_config(mcfg, device="cpu"):
    """The transformers GPT2Config (with FlashAttention 2's extra fields) that GPTLMHeadModel builds from."""
    from transformers import GPT2Config

    fused = _use_fused(mcfg, device)
    if mcfg.arch == "llama":
        from transformers import LlamaConfig

        from flash_attn.models.llama import llama_config_to_gpt2_config

        llama = LlamaConfig(
            vocab_size=mcfg.vocab_size, hidden_size=mcfg.n_embd, num_hidden_layers=mcfg.n_layer,
            num_attention_heads=mcfg.n_head, num_key_value_heads=mcfg.n_head_kv or mcfg.n_head,
            # LLaMA's SwiGLU keeps the MLP's parameter count near a 4x GELU MLP: 2/3 * 4 * d, rounded to 256.
            intermediate_size=mcfg.n_inner or 256 * ((8 * mcfg.n_embd // 3 + 255) // 256),
            max_position_embeddings=mcfg.n_positions, rms_norm_eps=mcfg.layer_norm_epsilon,
            rope_theta=mcfg.rotary_emb_base, tie_word_embeddings=mcfg.tie_word_embeddings,
            initializer_range=mcfg.initializer_range, attention_dropout=mcfg.dropout)
        config = llama_config_to_gpt2_config(llama)
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = mcfg.dropout
        config.initializer_range = mcfg.initializer_range
    elif mcfg.arch == "btlm":
        from types import SimpleNamespace

        from flash_attn.models.btlm import btlm_config_to_gpt2_config

        # BTLMConfig's fields: SwiGLU MLP of 8/3 * n_embd (BTLM-3B: 6826 for 2560), ALiBi, muP with scores / d
        btlm = SimpleNamespace(
            vocab_size=mcfg.vocab_size, n_positions=mcfg.n_positions, n_embd=mcfg.n_embd, n_layer=mcfg.n_layer,
            n_head=mcfg.n_head, n_inner=mcfg.n_inner or 8 * mcfg.n_embd // 3, activation_function="swiglu",
            resid_pdrop=mcfg.dropout, embd_pdrop=mcfg.dropout, attn_pdrop=mcfg.dropout,
            layer_norm_epsilon=mcfg.layer_norm_epsilon, initializer_range=mcfg.initializer_range,
            tie_word_embeddings=mcfg.tie_word_embeddings, position_embedding_type="alibi",
            mup_width_scale=mcfg.mup_width_scale, mup_embeddings_scale=mcfg.mup_embeddings_scale,
            mup_output_alpha=mcfg.mup_output_alpha, mup_scale_qk_dot_by_d=True)
        config = btlm_config_to_gpt2_config(btlm)
    else:
        config = GPT2Config(
            vocab_size=mcfg.vocab_size, n_positions=mcfg.n_positions, n_embd=mcfg.n_embd, n_layer=mcfg.n_layer,
            n_head=mcfg.n_head, n_inner=mcfg.n_inner, activation_function="gelu_new",
            resid_pdrop=mcfg.dropout, embd_pdrop=mcfg.dropout, attn_pdrop=mcfg.dropout,
            layer_norm_epsilon=mcfg.layer_norm_epsilon, initializer_range=mcfg.initializer_range,
            tie_word_embeddings=mcfg.tie_word_embeddings,
            # GPT-2's 50256 would be outside a smaller vocabulary; training never uses them.
            bos_token_id=None, eos_token_id=None)
        config.n_head_kv = mcfg.n_head_kv
        config.rotary_emb_fraction = mcfg.rotary_emb_fraction
        config.rotary_emb_base = mcfg.rotary_emb_base
        config.parallel_block = mcfg.parallel_block
        if mcfg.rotary_emb_fraction > 0:
            config.n_positions = 0  # rotary replaces learned positions
    config.pad_vocab_size_multiple = mcfg.pad_vocab_size_multiple
    config.residual_in_fp32 = mcfg.residual_in_fp32
    config.use_flash_attn = mcfg.use_flash_attn
    config.fused_dropout_add_ln = fused
    config.fused_bias_fc = fused
    # FusedMLP fuses the GELU of GPT-2's MLP (LLaMA's SwiGLU GatedMlp fuses its gating by itself); it keeps
    # Mlp's parameter names, so checkpoints move freely between fused and unfused runs.
    config.fused_mlp = fused and mcfg.arch == "gpt2"
    return config


def build_model(mcfg, device="cpu"):
    """A freshly initialised GPTLMHeadModel in fp32 on device (autocast supplies the low precision)."""
    from flash_attn.models.gpt import GPTLMHeadModel

    return GPTLMHeadModel(gpt2_config(mcfg, device), device=torch.device(device), dtype=torch.float32)


def shape_signature(mcfg):
    """The ModelConfig fields that decide parameter shapes, as a dict saved in every checkpoint."""
    return {name: getattr(mcfg, name) for name in SHAPE_FIELDS}


def check_shape(saved, mcfg, source):
    """Raise if a checkpoint's shape signature differs from this model config, naming every field."""
    current = shape_signature(mcfg)
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r} vs config {v!r}" for k, v in current.items()
             if saved.get(k) != v]
    if diffs:
        raise ConfigError(f"checkpoint {source!r} was saved from a different model shape: " + "; ".join(diffs))


def matmul_params(model):
    """Parameters used in matrix products per token: every nn.Linear weight, the LM head included (a tied
    head shares the embedding's tensor but still multiplies every token; the lookup itself and the norms
    cost no matmul FLOPs)."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel()
    return total


def flops_per_token(model, mcfg, seq_len):
    """Training FLOPs per token (forward + backward = 3x forward): 6 * matmul params for the dense layers,
    plus causal attention's QK^T and PV products, 6 * n_layer * seq_len * n_embd (half of the full
    12 * n_layer * seq_len * n_embd square, since the causal kernels skip the masked upper triangle)."""
    return 6 * matmul_params(model) + 6 * mcfg.n_layer * seq_len * mcfg.n_embd


def count_params(model):
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
