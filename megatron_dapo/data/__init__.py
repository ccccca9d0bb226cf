"""Prompt datasets, synthetic tasks and batching (micro-batch splitting, sequence packing)."""
