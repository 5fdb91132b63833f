"""Losses (flash_attn.losses): fused cross-entropy over large vocabularies."""
