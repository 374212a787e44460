"""Attention backends behind one interface (``base.AttentionBackend``), chosen by name through
``registry``: ``torch_native`` (plain torch ops, CPU and GPU) and ``triton`` (Triton kernels:
split-K decode, paged extend; GPU, or CPU under Triton's interpreter)."""
