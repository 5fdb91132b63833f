"""Model zoo (flash_attn.models): GPT-2, LLaMA, BERT, GPT-NeoX, GPT-J, OPT, Falcon, GPTBigCode, Baichuan and BTLM
built from the shared modules, and the Vision Transformer (vit)."""
