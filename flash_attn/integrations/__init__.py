"""Integrations with other libraries (flash_attn.integrations): ``transformers`` (an attention implementation
for HF's AttentionInterface)."""
