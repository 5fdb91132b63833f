"""Text generation from a training checkpoint, through flash_attn.utils.generation.decode (KV cache)."""
import torch

from flash_attn.training.checkpoint import load_checkpoint
from flash_attn.training.config import ConfigError, config_from_dict
from flash_attn.training.data import get_tokenizer
from flash_attn.training.model import build_model


def load_model(checkpoint, device="cpu"):
    """(model in eval mode, tokenizer, Config) from a checkpoint file, checkpoint folder or run folder."""
    state = load_checkpoint(checkpoint)
    cfg = config_from_dict(state["config"])
    device = torch.device(device)
    model = build_model(cfg.model, device)
    # Checkpoints hold the full (unsharded, unwrapped) state dict, so it loads into a plain model.
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if missing or unexpected:
        raise ConfigError(f"checkpoint {state['path']!r} does not match its own model config: missing "
                          f"{missing[:5]}, unexpected {unexpected[:5]}")
    if device.type == "cuda":
        model = model.to(torch.bfloat16)  # the GPU attention kernels take fp16/bf16
    model.eval()
    return model, get_tokenizer(cfg.data.tokenizer), cfg


def generate(checkpoint, prompt, max_new_tokens=100, top_k=0, top_p=0.9, temperature=0.8, seed=0,
             device="cpu", model=None, tokenizer=None):
    """Continue prompt (a string) by max_new_tokens tokens sampled from the checkpoint's model; returns the
    continuation only. top_k=1 is greedy. Pass model/tokenizer (from load_model) to reuse a loaded model."""
    from flash_attn.utils.generation import decode

    if model is None:
        model, tokenizer, _ = load_model(checkpoint, device)
    ids = tokenizer.encode(prompt)
    if len(ids) == 0:
        raise ValueError("the prompt must not be empty (it must encode to at least one token)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    device = next(model.parameters()).device
    input_ids = torch.as_tensor(ids, dtype=torch.long, device=device)[None]  # (1, S)
    torch.manual_seed(seed)
    out = decode(input_ids, model, max_length=input_ids.shape[1] + max_new_tokens, top_k=top_k, top_p=top_p,
                 temperature=temperature, vocab_size=model.config.vocab_size)
    return tokenizer.decode(out.sequences[0, input_ids.shape[1]:].tolist())
