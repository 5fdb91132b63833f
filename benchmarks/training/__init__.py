"""Training throughput and MFU of the trainer against Hugging Face transformers."""
