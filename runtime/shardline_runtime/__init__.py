"""Shardline inference runtime: TP model worker, scheduler and OpenAI-compatible server."""

__version__ = "0.1.0"
