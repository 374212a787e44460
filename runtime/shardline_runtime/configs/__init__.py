"""Parsed model configuration (``ModelConfig``)."""
