"""RFC 3339 timestamps as the Kubernetes API writes them (second precision, UTC, ``Z``)."""

from __future__ import annotations

from datetime import datetime, timezone


def to_rfc3339(seconds: float) -> str:
    """Unix seconds -> ``2026-01-02T03:04:05Z``."""
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_rfc3339(text: str | None) -> float | None:
    """``2026-01-02T03:04:05Z`` -> Unix seconds; None or malformed text gives None."""
    if not text:
        return None
    try:
        return (
            datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).timestamp()
        )
    except ValueError:
        return None
