"""Typed checkpoint errors: raised at load or validation time, message names the file/parameter."""


class CheckpointError(ValueError):
    """A checkpoint is unusable: missing or short shard, missing/unexpected/duplicate parameter,
    shape or dtype mismatch, or a config that differs from the running model."""


class ModelSourceError(ValueError):
    """A model reference cannot be fetched: malformed (names the field), not found (repository,
    revision, bucket, prefix), refused (401/403), or its bytes do not match the source's
    checksums. ``reason`` is a short CamelCase code for status conditions."""

    def __init__(self, message: str, reason: str = "InvalidModelSource") -> None:
        super().__init__(message)
        self.reason = reason


class SourceErrors:
    """A context manager turning a client library's errors into :class:`ModelSourceError`:
    subclasses implement :meth:`translate` (raise the typed error, or return to let ``exc``
    propagate); ``where`` names the source in every message."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None and not isinstance(exc, ModelSourceError):
            self.translate(exc)

    def translate(self, exc: BaseException) -> None:
        raise NotImplementedError
