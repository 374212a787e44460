"""Attention backends: ``torch_native_backend`` (CPU and GPU, graph-capturable decode)."""
