"""Quantized linear layers: one method per scheme (FP8 per-tensor / per-channel, FP8 block,
W4A16), chosen from the checkpoint's ``quantization_config`` (``registry.py``)."""
