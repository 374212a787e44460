"""Version fencing: a request pinned to a revision or ``weight_version`` is answered by those
weights or refused with a 503 naming them, never silently by others.

RL loops label each sample with the weight version that generated it (dynamo#15214,
sglang#7773 and vllm-project/router#294 ask for this across a fleet). A client pins by sending
``X-Shardline-Revision`` and/or ``X-Shardline-Weight-Version`` (``entrypoints/version_headers``
reads them). The pin is checked three times:

1. before admission: a server that does not serve the pinned weights, or is updating them
   (``loading`` / ``recapturing``: what it serves afterwards is not known yet), refuses at once
   rather than holding the request for the update;
2. after admission (an update may have started and ended while the request was held);
3. on every output chunk: each chunk is stamped with the weights that produced it (the
   schedulers send their new ``WeightsState`` before any output of the new weights, on the same
   socket), so a request that waited in the scheduler's queue across an update is aborted at its
   first token from the other weights and answered 503 (an error event, for a stream whose
   headers went out).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline_runtime.managers.admission_gate import ServerNotReadyError
from shardline_runtime.weights_state import WeightsState


class VersionNotServedError(ServerNotReadyError):
    """The pinned revision or weight_version is not what this server serves (HTTP 503).

    The message names the pinned version and what this server serves; no ``Retry-After``: the
    client should go to a server of its version (the per-revision Service), not retry here.
    """


@dataclass(frozen=True)
class VersionPin:
    """The weights a request demands: a ``revision`` (the label the weights were loaded or
    updated with, ``--revision``) and/or a ``weight_version`` (SGLang's free-form string, set by
    weight updates). None in a field: any value is accepted."""

    revision: str | None = None
    weight_version: str | None = None

    def describe(self) -> str:
        """``revision 'rev-a'`` / ``weight_version '7'`` / both, for messages."""
        parts = []
        if self.revision is not None:
            parts.append(f"revision {self.revision!r}")
        if self.weight_version is not None:
            parts.append(f"weight_version {self.weight_version!r}")
        return " and ".join(parts)

    def mismatch(self, revision: str | None, weight_version: str | None) -> str | None:
        """Why weights of ``revision`` / ``weight_version`` do not satisfy the pin, or None."""
        wrong_revision = self.revision is not None and revision != self.revision
        wrong_version = self.weight_version is not None and weight_version != self.weight_version
        if not (wrong_revision or wrong_version):
            return None
        return (
            f"pinned {self.describe()} is not served here: this server serves revision "
            f"{revision!r}, weight_version {weight_version!r}; send the request to a server of "
            f"{self.describe()} (its per-revision Service) or drop the pin"
        )

    def check(self, weights: WeightsState) -> None:
        """Raises VersionNotServedError unless ``weights`` serve the pinned version now (an
        update in progress refuses too: its outcome is not known yet)."""
        if weights.phase.updating:
            raise VersionNotServedError(
                f"pinned {self.describe()} cannot be guaranteed: this server is updating its "
                f"weights (phase {weights.phase.value}, from revision {weights.revision!r}); "
                f"send the request to another server of {self.describe()}"
            )
        reason = self.mismatch(weights.revision, weights.weight_version)
        if reason is not None:
            raise VersionNotServedError(reason)
