"""Model zoo (flash_attn.models): GPT-2, LLaMA, BERT, GPT-NeoX and GPT-J built from the shared modules."""
