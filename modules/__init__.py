"""Shared attention/MLP/embedding/block modules (flash_attn.modules)."""
