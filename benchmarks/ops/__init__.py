"""The fused ops (norms, cross-entropy, activations): time and bandwidth against torch.compile and a copy."""
