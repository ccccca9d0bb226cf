"""Rollout engines (embedded HF, vLLM, SGLang) and actor -> engine weight sync."""
