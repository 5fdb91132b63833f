"""Whole models (training step, decoding) against Hugging Face transformers."""
