"""Checkpoint discovery, validation and weight loading."""
