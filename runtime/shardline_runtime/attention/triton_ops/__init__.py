"""Triton kernels of the ``triton`` attention backend (GPU, or CPU under ``TRITON_INTERPRET=1``).

``kv_indices``: flatten each request's ``req_to_token`` row into one index list.
``decode_attention``: split-K (flash-decoding) decode over those indices.
``extend_attention``: prefill after a cached prefix, read through ``req_to_token``.
"""
