"""Benchmark scripts, grouped by what they measure; run each as a module from the repository root."""
