"""Model zoo (flash_attn.models): GPT-2, LLaMA, BERT built from the shared modules."""
