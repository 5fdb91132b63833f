"""Layers shared by the models (flash_attn.layers): rotary position embeddings, the ViT patch embedding."""
