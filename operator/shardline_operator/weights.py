"""What a group's leader says it serves: the ``weights`` block of ``/get_server_info``.

The runtime serialises its one ``WeightsState`` record (``weights_state.py``) as the
``weights`` block: ``{model_path, revision, weight_version, phase, digest, last_update}``, with
``phase`` one of :class:`WeightsPhase`'s values and ``last_update`` either None or
``{success, model_path, load_seconds, recapture_seconds}``, and ``graphs`` either None or
``{decode_batch_sizes, piecewise_token_buckets, reason}`` (what the runtime really captured);
with a draft model, ``draft_model_path``, ``draft_digest`` and ``draft_source_revision``.
The operator never imports the
runtime, so this module mirrors the enum and parses the block by hand;
``tests/contract/test_weights_state_contract.py`` pins the two sides together. A runtime that
predates the block is read from the flat keys it still writes (``weights_phase``,
``weights_revision``, ``weights_digest``, ``weight_version``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .phases import TextEnum


class WeightsPhase(TextEnum):
    """Phase of a leader's serving weights (mirrors the runtime's ``WeightsPhase``)."""

    SERVING = "serving"
    LOADING = "loading"
    RECAPTURING = "recapturing"
    FAILED = "failed"

    @property
    def updating(self) -> bool:
        """True while an update runs on the leader (loading or recapturing graphs)."""
        return self in (WeightsPhase.LOADING, WeightsPhase.RECAPTURING)

    @classmethod
    def parse(cls, value: Any) -> WeightsPhase:
        """The phase named by ``value``; an unknown or missing value reads as ``serving``
        (an old runtime without phases serves what it loaded)."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            return cls.SERVING


@dataclass(frozen=True)
class LastUpdate:
    """The leader's last weight update: its outcome and phase times in seconds (None: unmeasured)."""

    success: bool
    model_path: str
    load_seconds: float | None = None
    recapture_seconds: float | None = None

    @classmethod
    def from_block(cls, raw: Any) -> LastUpdate | None:
        if not isinstance(raw, Mapping):
            return None
        return cls(
            bool(raw.get("success")),
            str(raw.get("model_path") or ""),
            _seconds(raw.get("load_seconds")),
            _seconds(raw.get("recapture_seconds")),
        )


def _sizes(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, (list, tuple)):
        return ()
    return tuple(sorted(int(v) for v in raw if isinstance(v, int) and not isinstance(v, bool)))


@dataclass(frozen=True)
class ReportedGraphs:
    """The device graphs a leader says it captured (mirrors the runtime's ``CapturedGraphs``).

    ``decode_batch_sizes`` / ``piecewise_token_buckets``: sorted, empty when none; ``reason``:
    why nothing was captured (e.g. ``"cpu: no CUDA graphs"``), None when graphs were;
    ``torch_compile_batch_sizes``: decode sizes run by the ``--enable-torch-compile`` forward;
    speculative decoding: ``verify_batch_sizes`` (of ``verify_tokens_per_request`` tokens each),
    ``draft_batch_sizes`` (the draft model's decode graphs), ``speculative_reason`` (why either
    is missing).
    """

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
        """True when at least one graph of either kind was captured."""
        return bool(self.decode_batch_sizes or self.piecewise_token_buckets)

    def summary(self) -> str:
        """One line for status: ``decode batch sizes 1-160 (23 graphs)``, ``piecewise ...``, or
        ``none: <reason>``."""
        parts = [
            f"{kind} {label} {sizes[0]}-{sizes[-1]} ({len(sizes)} graphs)"
            for kind, label, sizes in (
                ("decode", "batch sizes", self.decode_batch_sizes),
                ("piecewise", "tokens", self.piecewise_token_buckets),
                ("verify", "batch sizes", self.verify_batch_sizes),
                ("draft", "batch sizes", self.draft_batch_sizes),
            )
            if sizes
        ]
        return "; ".join(parts) or f"none: {self.reason or 'no reason reported'}"

    @classmethod
    def from_block(cls, raw: Any) -> ReportedGraphs | None:
        if not isinstance(raw, Mapping):
            return None
        return cls(
            _sizes(raw.get("decode_batch_sizes")),
            _sizes(raw.get("piecewise_token_buckets")),
            _text(raw.get("reason")),
            _sizes(raw.get("torch_compile_batch_sizes")),
            _sizes(raw.get("verify_batch_sizes")),
            _count(raw.get("verify_tokens_per_request")),
            _sizes(raw.get("draft_batch_sizes")),
            _text(raw.get("speculative_reason")),
        )


def _count(raw: Any) -> int:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else 0


# (phase, model path, revision, digest, weight version) in the ``weights`` block, and in the
# flat keys a runtime without the block writes.
_BLOCK_KEYS = ("phase", "model_path", "revision", "digest", "weight_version", "source_revision")
_FLAT_KEYS = (
    "weights_phase",
    "model_path",
    "weights_revision",
    "weights_digest",
    "weight_version",
    "weights_source_revision",
)
DRAFT_KEYS = ("draft_model_path", "draft_digest", "draft_source_revision")  # block only
SOURCE_SEPARATOR = ";source="


def digest_with_source(digest: str, source_revision: str | None) -> str:
    """The ``weightsDigest`` status records: the checkpoint ``digest``, and when the leader
    reports the resolved source revision it loaded (a Hub commit, an S3 listing digest),
    ``<digest>;source=<source_revision>``."""
    return f"{digest}{SOURCE_SEPARATOR}{source_revision}" if source_revision else digest


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class LeaderReport:
    """``/get_server_info`` of a group's leader, as far as the operator cares.

    ``revision``/``digest``: what serves (``digest`` is ``sha256:<hex>`` of the checkpoint, None
    when the runtime could not read it); ``message``: the runtime's last error line;
    ``graphs``: the graphs it captured (None: a runtime that does not report them).
    ``quantization``: the served scheme (None from a runtime that does not report it).
    ``model_kind``: ``generate`` or ``embed``, what the leader serves (likewise).
    ``source_revision``: the Hub commit or S3 listing digest the served directory was verified
    as when fetched (None: a local directory, or a runtime that does not report it).
    ``draft_model_path`` / ``draft_digest`` / ``draft_source_revision``: the same for the draft
    model or EAGLE head (None: no draft, or a runtime that does not report it).
    """

    weights_phase: WeightsPhase
    model_path: str | None = None
    revision: str | None = None
    digest: str | None = None
    message: str = ""
    weight_version: str | None = None
    last_update: LastUpdate | None = None
    graphs: ReportedGraphs | None = None
    quantization: str | None = None  # the served scheme (``unquantized``, ``fp8-...``)
    model_kind: str | None = None  # ``generate`` or ``embed`` (None: a runtime without it)
    source_revision: str | None = None
    draft_model_path: str | None = None
    draft_digest: str | None = None
    draft_source_revision: str | None = None

    def __post_init__(self) -> None:  # a plain string phase (a test's literal) reads as the enum
        object.__setattr__(self, "weights_phase", WeightsPhase.parse(self.weights_phase))

    @classmethod
    def from_info(cls, info: Mapping[str, Any] | None) -> LeaderReport | None:
        """Parse ``/get_server_info`` (None or empty: unreachable -> None)."""
        if not info:
            return None
        block = info.get("weights")
        source: Mapping[str, Any] = block if isinstance(block, Mapping) else info
        keys = _BLOCK_KEYS if isinstance(block, Mapping) else _FLAT_KEYS
        phase, path, revision, digest, version, resolved = (source.get(key) for key in keys)
        return cls(
            WeightsPhase.parse(phase),
            _text(path),
            _text(revision),
            _text(digest),
            str(info.get("message") or ""),
            _text(version),
            LastUpdate.from_block(source.get("last_update")),
            ReportedGraphs.from_block(
                source.get("graphs") if isinstance(block, Mapping) else info.get("cuda_graphs")
            ),
            _text(source.get("quantization")),
            _text(info.get("model_kind")),
            _text(resolved),
            *(_text(source.get(key)) for key in DRAFT_KEYS),
        )
