"""Attention kernels: throughput against peers, per-call cost, A/B of kernel variants."""
