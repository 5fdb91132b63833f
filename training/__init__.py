"""Training scripts and configs (flash_attn.training)."""
