"""Model zoo (flash_attn.models): GPT-2, LLaMA, BERT, GPT-NeoX, GPT-J, OPT and Falcon built from the shared modules."""
