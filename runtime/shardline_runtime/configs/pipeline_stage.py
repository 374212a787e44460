"""Which layers a pipeline stage owns: the split of the decoder layers over ``pp_size`` stages.

The model receives a :class:`PipelineStage` when it is built and creates only the layers in
``[start_layer, end_layer)`` (others are :class:`~shardline_runtime.models.llama.PPMissingLayer`
placeholders, so layer indices and checkpoint names stay global), the embedding on the first
stage and the final norm and LM head on the last. Models never learn their rank from
``torch.distributed``: this object is all they know about the pipeline.

Default split (as vLLM's and SGLang's ``get_pp_indices``): ``num_layers // pp_size`` layers per
stage, and the remainder one extra each on the stages just before the last, because the last
stage also runs the norm, the LM head and sampling. ``--pp-layer-partition`` gives the counts
explicitly (uneven splits allowed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class PipelineLayoutError(ValueError):
    """The model's layers cannot be split over the pipeline stages as asked (names the flag)."""


def layer_partition(
    num_layers: int, pp_size: int, partition: Sequence[int] | None = None
) -> list[int]:
    """Layers per stage, in stage order.

    Args:
        num_layers: decoder layers of the model (``num_hidden_layers``).
        pp_size: pipeline stages.
        partition: explicit layer counts per stage (``--pp-layer-partition``), or None.

    Raises:
        PipelineLayoutError: fewer layers than stages, or a partition of the wrong length, with a
            stage of no layer, or not summing to ``num_layers``.
    """
    if pp_size < 1:
        raise PipelineLayoutError(f"--pp-size must be >= 1, got {pp_size}")
    if num_layers < pp_size:
        raise PipelineLayoutError(
            f"the model has {num_layers} layers but --pp-size is {pp_size}: every pipeline stage needs at "
            f"least one layer; use --pp-size <= {num_layers}"
        )
    if partition:
        counts = [int(c) for c in partition]
        if len(counts) != pp_size or any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise PipelineLayoutError(
                f"--pp-layer-partition {','.join(map(str, counts))} must give {pp_size} stages (--pp-size) of at "
                f"least one layer each, summing to the model's {num_layers} layers"
            )
        return counts
    counts = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        counts[-2 - i] += 1  # stages before the last take the remainder (the last has the LM head)
    return counts


@dataclass(frozen=True)
class PipelineStage:
    """The layer range of one stage: layers ``[start_layer, end_layer)`` of ``num_layers``."""

    start_layer: int = 0
    end_layer: int | None = None  # None: to the last layer (a model without pipeline)
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def is_first(self) -> bool:
        """Runs the token embedding."""
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        """Runs the final norm and the LM head, and samples."""
        return self.pp_rank == self.pp_size - 1

    def end(self, num_layers: int) -> int:
        return num_layers if self.end_layer is None else self.end_layer

    def owns_layer(self, layer_id: int) -> bool:
        return (
            self.start_layer
            <= layer_id
            < (self.end_layer if self.end_layer is not None else layer_id + 1)
        )

    @classmethod
    def for_rank(
        cls, num_layers: int, pp_rank: int, pp_size: int, partition: Sequence[int] | None = None
    ) -> PipelineStage:
        """The stage ``pp_rank`` of a ``pp_size``-stage pipeline (see :func:`layer_partition`)."""
        counts = layer_partition(num_layers, pp_size, partition)
        start = sum(counts[:pp_rank])
        return cls(start, start + counts[pp_rank], pp_rank, pp_size)


def parse_layer_partition(text: str | None) -> tuple[int, ...]:
    """``"10,11,11"`` -> (10, 11, 11); None or "" -> ().

    Raises:
        PipelineLayoutError: not a comma list of positive integers.
    """
    if not text:
        return ()
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise PipelineLayoutError(
            f"--pp-layer-partition must be comma-separated layer counts like 10,11,11, got {text!r}"
        ) from None
    if any(c < 1 for c in counts):
        raise PipelineLayoutError(f"--pp-layer-partition counts must each be >= 1, got {text!r}")
    return counts
