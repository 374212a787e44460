"""Constrained decoding: grammar specs (from the request fields), the grammar library behind one
small interface (``xgrammar_backend.py``), and the per-request matchers that fill token bitmasks."""
