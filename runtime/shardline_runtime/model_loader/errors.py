"""Typed checkpoint errors: raised at load or validation time, message names the file/parameter."""


class CheckpointError(ValueError):
    """A checkpoint is unusable: missing or short shard, missing/unexpected/duplicate parameter,
    shape or dtype mismatch, or a config that differs from the running model."""
