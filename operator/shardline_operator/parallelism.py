"""``spec.parallelism``: the ranks of one group and how they are laid out over its pods (pure).

A group (one model replica) has ``world_size = tensor x pipeline`` ranks. Ranks are laid out
as SGLang lays them out: ``rank = pp_rank * tensor + tp_rank`` (the TP ranks of one pipeline
stage are consecutive), and pod ``n`` (the StatefulSet ordinal = the runtime's ``--node-rank``)
runs the ``gpusPerPod`` consecutive ranks ``n * gpusPerPod .. n * gpusPerPod + gpusPerPod - 1``.

A pod never splits a stage's TP ranks unevenly: either a stage spans whole pods
(``tensor`` a multiple of ``gpusPerPod``: TP inside and across pods, one stage per pod group)
or a pod holds whole stages (``gpusPerPod`` a multiple of ``tensor``). SGLang's launcher
supports exactly these two cases (``nnodes_per_tp_group`` / ``pp_size_per_node``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MAX_WORLD_SIZE = 1024  # ranks per group: tensor x pipeline
MAX_PIPELINE = 64


@dataclass(frozen=True)
class PodRanks:
    """The ranks one pod runs: every pair of ``pp_ranks`` x ``tp_ranks`` (ascending)."""

    pp_ranks: tuple[int, ...]
    tp_ranks: tuple[int, ...]


@dataclass(frozen=True)
class ParallelismSpec:
    """``spec.parallelism`` of one group.

    ``tensor``: TP ranks per pipeline stage (``--tp-size``); ``pipeline``: pipeline stages
    (``--pp-size``), each running a contiguous range of the decoder layers;
    ``pipeline_layer_partition``: layers per stage (``--pp-layer-partition``), empty for the
    runtime's even split; ``gpus_per_pod``: ranks per pod; ``expert``: expert-parallel size of
    MoE models (divides ``tensor``; ``--ep-size``).
    """

    tensor: int = 1
    gpus_per_pod: int = 1
    expert: int = 1
    pipeline: int = 1
    pipeline_layer_partition: tuple[int, ...] = ()

    @property
    def world_size(self) -> int:
        """Ranks (GPUs) of one group: ``tensor x pipeline``."""
        return self.tensor * self.pipeline

    @property
    def pods_per_group(self) -> int:
        """Pods of one group (the runtime's ``--nnodes``): ``tensor x pipeline / gpusPerPod``."""
        return self.world_size // self.gpus_per_pod

    def pod_ranks(self, node_rank: int) -> PodRanks:
        """The (pp, tp) ranks pod ``node_rank`` runs (SGLang's layout, see the module docstring).

        Raises:
            ValueError: ``node_rank`` is outside ``[0, pods_per_group)``.
        """
        if not 0 <= node_rank < self.pods_per_group:
            raise ValueError(f"node_rank must be in [0, {self.pods_per_group}), got {node_rank}")
        ranks = range(node_rank * self.gpus_per_pod, (node_rank + 1) * self.gpus_per_pod)
        return PodRanks(
            pp_ranks=tuple(sorted({r // self.tensor for r in ranks})),
            tp_ranks=tuple(sorted({r % self.tensor for r in ranks})),
        )

    def layout_error(self) -> str | None:
        """Why these sizes cannot be laid out over pods (a message naming the fields), or None."""
        allowed = [d for d in range(1, self.tensor + 1) if self.tensor % d == 0]
        if self.tensor % self.expert != 0:
            return (
                f"expert ({self.expert}) must divide tensor ({self.tensor}): experts are split over "
                f"expert groups of tensor / expert ranks; allowed: {allowed}"
            )
        if self.world_size > MAX_WORLD_SIZE:
            return (
                f"tensor x pipeline ({self.tensor} x {self.pipeline} = {self.world_size}) must be at most "
                f"{MAX_WORLD_SIZE} ranks per group"
            )
        if self.pipeline == 1 and self.tensor % self.gpus_per_pod != 0:
            return f"tensor ({self.tensor}) must be a multiple of gpusPerPod ({self.gpus_per_pod})"
        if self.world_size % self.gpus_per_pod != 0:
            return (
                f"tensor x pipeline ({self.tensor} x {self.pipeline} = {self.world_size}) must be a multiple of "
                f"gpusPerPod ({self.gpus_per_pod}): every pod runs gpusPerPod ranks"
            )
        if self.tensor % self.gpus_per_pod != 0 and self.gpus_per_pod % self.tensor != 0:
            return (
                f"gpusPerPod ({self.gpus_per_pod}) must divide tensor ({self.tensor}) or be a multiple of it: "
                "a pipeline stage spans whole pods, or a pod holds whole stages"
            )
        partition = self.pipeline_layer_partition
        if partition and len(partition) != self.pipeline:
            return (
                f"pipelineLayerPartition gives {len(partition)} stages ({list(partition)}) but pipeline is "
                f"{self.pipeline}: give one layer count per stage"
            )
        return None

    def restart_fields(self) -> dict[str, Any]:
        """The fields whose change needs new pods, for ``DeploymentSpec.restart_hash``.

        Pipeline fields at their defaults are left out, so the hash of a deployment created
        before they existed does not change (an operator upgrade restarts nothing).
        """
        fields = asdict(self)
        if self.pipeline == 1:
            del fields["pipeline"]
        if not self.pipeline_layer_partition:
            del fields["pipeline_layer_partition"]
        return fields
