"""The one function that renders the runtime container's command line.

A contract test (``tests/contract``) expands the ``$(VAR)`` references as kubelet does and
parses the result with ``shardline_runtime.server_args.make_parser()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import labels
from .spec import CudaGraphSpec, DeploymentSpec
from .spec_model import MODEL_CACHE_ENV

RUNTIME_COMMAND = ("shardline-runtime", "serve")


DRAFT_FLAG = "--speculative-draft-model-path"


@dataclass(frozen=True)
class ServedModel:
    """What one group's pods load at start: checkpoint directory, its revision label, graph
    setup, and the draft model or EAGLE head (``spec.runtime.speculative.draftModel``'s path or
    uri; None without one).

    It differs from the spec while an in-place rollout has not reached the group yet: the target
    and the draft roll in place together (issue 30).
    """

    path: str
    revision: str
    cuda_graph: CudaGraphSpec
    draft: str | None = None

    @classmethod
    def desired(cls, spec: DeploymentSpec) -> ServedModel:
        """The model the spec asks every group to serve."""
        speculative = spec.runtime.speculative
        return cls(
            path=spec.model.path,
            revision=spec.model.revision,
            cuda_graph=spec.runtime.cuda_graph,
            draft=None if speculative is None else speculative.draft_model_path,
        )

    def checkpoints(self) -> tuple[str, str, str | None]:
        """``(path, revision, draft)``: what a change of needs new bytes (not the graphs)."""
        return self.path, self.revision, self.draft

    def served_by(self, model_path: str | None, revision: str | None, draft: str | None) -> bool:
        """A leader reporting ``model_path``, ``revision`` and ``draft`` (its draft's reported
        path or uri; None from a runtime without a draft or one that does not report it) serves
        this model."""
        same_draft = draft is None or self.draft is None or draft == self.draft
        return (model_path, revision) == (self.path, self.revision) and same_draft


def draft_in_args(args: list[str]) -> str | None:
    """The ``--speculative-draft-model-path`` value in a container's ``args`` (None: absent)."""
    for i, arg in enumerate(args[:-1]):
        if arg == DRAFT_FLAG:
            return args[i + 1]
    return None


def runtime_args(spec: DeploymentSpec, group: int, served: ServedModel) -> list[str]:
    """Arguments of ``shardline-runtime serve`` for every pod of group ``group``.

    ``$(POD_IP)`` and ``$(POD_INDEX)`` are expanded by kubelet from the downward-API env of the
    same names, so all pods of a group share one template and the node rank is the pod ordinal.
    With ``--pp-size`` the group's ``tensor x pipeline`` ranks span ``--nnodes`` pods; the
    runtime maps ``--node-rank`` to its (pp, tp) ranks as ``ParallelismSpec.pod_ranks`` does.
    User ``spec.runtime.args`` come last (reserved flags are rejected by ``parse_spec``).
    """
    args = [
        "--model-path",
        served.path,
        "--served-model-name",
        spec.model.name,
        "--revision",
        served.revision,
        "--host",
        "$(POD_IP)",
        "--port",
        str(labels.HTTP_PORT),
        "--tp-size",
        str(spec.parallelism.tensor),
        "--nnodes",
        str(spec.parallelism.pods_per_group),
        "--node-rank",
        "$(POD_INDEX)",
        "--dist-init-addr",
        labels.dist_init_addr(spec.name, spec.namespace, group),
        "--dtype",
        spec.runtime.dtype,
        "--kv-cache-dtype",
        spec.runtime.kv_cache_dtype,
        "--quantization",
        spec.runtime.quantization,
        "--mem-fraction-static",
        repr(spec.runtime.mem_fraction_static),
    ]
    if spec.model.kind != "auto":  # only when declared: existing pod templates stay as they are
        args += ["--model-kind", spec.model.kind]
    if spec.model.is_remote:
        args += ["--download-dir", f"$({MODEL_CACHE_ENV})"]  # env: remapped by hosts that must
        if spec.model.cache_max_bytes:
            args += ["--download-max-bytes", str(spec.model.cache_max_bytes)]
    if spec.parallelism.pipeline > 1:
        args += ["--pp-size", str(spec.parallelism.pipeline)]
    if spec.parallelism.pipeline_layer_partition:
        args += [
            "--pp-layer-partition",
            ",".join(map(str, spec.parallelism.pipeline_layer_partition)),
        ]
    if spec.parallelism.expert > 1:
        args += ["--ep-size", str(spec.parallelism.expert)]
    if spec.runtime.max_total_tokens is not None:
        args += ["--max-total-tokens", str(spec.runtime.max_total_tokens)]
    if served.cuda_graph.enabled:
        args += ["--cuda-graph-max-bs", str(served.cuda_graph.max_batch_size)]
    else:
        args.append("--disable-cuda-graph")
    if spec.runtime.speculative is not None:
        args += [
            "--speculative-algorithm",
            spec.runtime.speculative.algorithm,
            "--speculative-num-draft-tokens",
            str(spec.runtime.speculative.num_draft_tokens),
        ]
        # the group's draft: rolled in place with the target, so it may lag the spec's
        if spec.runtime.speculative.draft_model_path is not None:
            args += [DRAFT_FLAG, served.draft or spec.runtime.speculative.draft_model_path]
    if (
        spec.lora_adapters
    ):  # loaded at start; later changes are loaded/unloaded in place (lora_sync.py)
        args += [
            "--enable-lora",
            "--lora-paths",
            *(f"{a.name}={a.path}" for a in spec.lora_adapters),
        ]
    return args + list(spec.runtime.args)
