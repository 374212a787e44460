"""Which weights serve, and in which phase: one frozen record with one owner.

The scheduler's control plane (rank 0) owns the live :class:`WeightsState` and sends it whole
to the HTTP process whenever any field changes; the HTTP process keeps exactly one copy and
``/get_server_info`` serialises it as its ``weights`` block (``WeightsState.model_dump(mode=
"json")``). The operator parses that block; ``tests/contract`` pins the two sides together, since
the operator never imports the runtime. After SGLang's single ``weight_version`` recorded in one
place (``scheduler.record_weight_version_change``).
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict


class WeightsPhase(str, Enum):
    """Phase of the serving weights.

    ``SERVING``: weights loaded, generation admitted; ``LOADING``: a new checkpoint is being
    validated or copied in; ``RECAPTURING``: device graphs are captured again; ``FAILED``: the
    last update failed (the old weights still serve when the failure was all-or-nothing).
    """

    SERVING = "serving"
    LOADING = "loading"
    RECAPTURING = "recapturing"
    FAILED = "failed"

    @property
    def updating(self) -> bool:
        """True while an update runs (``/ready`` answers 503 and new requests are held)."""
        return self in (WeightsPhase.LOADING, WeightsPhase.RECAPTURING)


class UpdateTimings(BaseModel):
    """The last weight update's outcome and rank 0's phase times, in seconds."""

    model_config = ConfigDict(frozen=True)

    success: bool
    model_path: str
    load_seconds: float | None = None
    recapture_seconds: float | None = None


class CapturedGraphs(BaseModel):
    """The device graphs the weights serve through, as rank 0 really captured them.

    ``decode_batch_sizes``: batch sizes with a captured decode graph (sorted; empty: none);
    ``piecewise_token_buckets``: token counts with captured piecewise EXTEND graphs (sorted;
    empty: none); ``reason``: why nothing was captured (``"cpu: no CUDA graphs"``,
    ``"disabled by flag: --disable-cuda-graph"``, a rule of ``device_graphs.py``), None when
    graphs were captured; ``torch_compile_batch_sizes``: decode batch sizes that run the
    ``--enable-torch-compile`` forward (inside their graphs on a GPU; empty: compile is off).
    Speculative decoding: ``verify_batch_sizes`` (TARGET_VERIFY graphs, each of
    ``verify_tokens_per_request`` tokens per request, 0 when none), ``draft_batch_sizes`` (the
    draft runner's decode graphs: STANDALONE decode steps, EAGLE chain steps) and
    ``speculative_reason`` (why verify or draft graphs are missing while speculation is on,
    ``"verify: ...; draft: ..."``; None otherwise). Captured again with every update that
    recaptures, so a new record carries a new report.
    """

    model_config = ConfigDict(frozen=True)

    decode_batch_sizes: tuple[int, ...] = ()
    piecewise_token_buckets: tuple[int, ...] = ()
    reason: str | None = None
    torch_compile_batch_sizes: tuple[int, ...] = ()
    verify_batch_sizes: tuple[int, ...] = ()
    verify_tokens_per_request: int = 0
    draft_batch_sizes: tuple[int, ...] = ()
    speculative_reason: str | None = None

    @property
    def captured(self) -> bool:
        """True when at least one decode or piecewise graph was captured."""
        return bool(self.decode_batch_sizes or self.piecewise_token_buckets)


class WeightsState(BaseModel):
    """What serves: ``model_path`` (directory), ``revision`` (label given at load or update),
    ``weight_version`` (SGLang's free-form version string, ``"default"`` at start), ``phase``,
    ``digest`` (:func:`~shardline_runtime.model_loader.checkpoint_digest.checkpoint_digest` of
    the served checkpoint, computed where it was loaded; None when unreadable),
    ``source_revision`` (the Hub commit or S3 listing digest the served directory was verified
    as when fetched, read from its cache record; None for a local directory), ``quantization``
    (the served scheme, ``layers/quantization/``: ``unquantized``, ``fp8-w8a8-dynamic-channel``,
    ...; an update never changes it, a change of scheme is refused), ``last_update`` (None
    until the first update ran) and ``graphs`` (the :class:`CapturedGraphs` report; None until
    the runner reported one). With a draft model or EAGLE head (``--speculative-algorithm
    STANDALONE`` / ``EAGLE``): ``draft_model_path`` (its directory, or the hf:// / s3:// reference
    it was fetched from), ``draft_digest`` and ``draft_source_revision``, the same records for
    the draft; all None without one. A disk update that carries ``draft_model_path`` changes
    them with the target's, in the same record.

    Frozen: a change is a new record (``state.model_copy(update={...})``).
    """

    model_config = ConfigDict(frozen=True)

    model_path: str
    revision: str | None = None
    weight_version: str = "default"
    phase: WeightsPhase = WeightsPhase.SERVING
    digest: str | None = None
    source_revision: str | None = None
    quantization: str = "unquantized"
    last_update: UpdateTimings | None = None
    graphs: CapturedGraphs | None = None
    draft_model_path: str | None = None
    draft_digest: str | None = None
    draft_source_revision: str | None = None
