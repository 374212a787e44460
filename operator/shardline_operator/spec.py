"""Parse and validate ``InferenceDeployment.spec`` into frozen dataclasses.

The CRD schema (``crds/inferencedeployment.yaml``) rejects most bad input at the API server;
this module repeats those checks (the operator must also be safe against objects created
before a schema change, and unit tests run without an API server) and adds what a schema
cannot express. Defaults here equal the CRD defaults. Every error names the field path and the
allowed values: ``SpecError("spec.parallelism: tensor (3) must be a multiple of gpusPerPod (2)")``.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from typing import Any

from .parallelism import MAX_PIPELINE, MAX_WORLD_SIZE, ParallelismSpec
from .spec_draft import check_draft_source, parse_draft_model
from .spec_fields import field_value, int_in, one_of
from .spec_model import LABEL_VALUE as _LABEL_VALUE
from .spec_model import SECRET_NAME as _SECRET_NAME
from .spec_model import parse_model
from .spec_types import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    DEFAULT_MAX_LORAS_PER_BATCH,
    DRAIN_TIMEOUT_FLAG,
    DTYPES,
    GPU_RESOURCE,
    KV_CACHE_DTYPES,
    MAX_NAME_LENGTH,
    MAX_REPLICAS,
    MODEL_KINDS,
    PULL_POLICIES,
    QUANTIZATION_MODES,
    RESERVED_ENV,
    RESERVED_FLAGS,
    SERVICE_TYPES,
    SPECULATIVE_ALGORITHMS,
    STRATEGIES,
    AuthSpec,
    CanarySpec,
    CudaGraphSpec,
    DeploymentSpec,
    LoRAAdapterSpec,
    ModelSpec,
    NetworkPolicySpec,
    RestartPolicySpec,
    RuntimeSpec,
    SchedulingSpec,
    SecretKeyRef,
    ServiceSpec,
    SpecError,
    SpeculativeSpec,
    VerifySpec,
    WeightUpdateSpec,
    flag_value,
)

__all__ = [
    "ADMIN_API_KEY_ENV",
    "API_KEY_ENV",
    "AuthSpec",
    "CanarySpec",
    "CudaGraphSpec",
    "DEFAULT_MAX_LORAS_PER_BATCH",
    "DTYPES",
    "DeploymentSpec",
    "GPU_RESOURCE",
    "KV_CACHE_DTYPES",
    "LoRAAdapterSpec",
    "MAX_NAME_LENGTH",
    "MAX_REPLICAS",
    "MODEL_KINDS",
    "ModelSpec",
    "NetworkPolicySpec",
    "PULL_POLICIES",
    "QUANTIZATION_MODES",
    "RESERVED_ENV",
    "RESERVED_FLAGS",
    "RestartPolicySpec",
    "RuntimeSpec",
    "SERVICE_TYPES",
    "STRATEGIES",
    "SchedulingSpec",
    "SecretKeyRef",
    "ServiceSpec",
    "SpecError",
    "VerifySpec",
    "WeightUpdateSpec",
    "parse_spec",
]

_DNS_LABEL = re.compile(r"^[a-z]([a-z0-9-]*[a-z0-9])?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def parse_runtime(raw: Mapping[str, Any]) -> RuntimeSpec:
    """Parse ``spec.runtime``. Raises :class:`SpecError`."""
    path = "spec.runtime"
    image = field_value(raw, "image", path, str, required=True)
    if not image.strip():
        raise SpecError(f"{path}.image must be a non-empty image reference")
    fraction = field_value(raw, "memFractionStatic", path, (int, float), 0.85)
    if not 0.0 < float(fraction) <= 1.0:
        raise SpecError(f"{path}.memFractionStatic must be in (0, 1], got {fraction}")
    graph_raw = field_value(raw, "cudaGraph", path, dict, {})
    cuda_graph = CudaGraphSpec(
        enabled=field_value(graph_raw, "enabled", f"{path}.cudaGraph", bool, True),
        max_batch_size=int_in(graph_raw, "maxBatchSize", f"{path}.cudaGraph", 160, 1, 4096),
    )
    args = tuple(field_value(raw, "args", path, list, []))
    for arg in args:
        if not isinstance(arg, str):
            raise SpecError(f"{path}.args must be a list of strings, got {arg!r}")
        if arg.split("=", 1)[0] in RESERVED_FLAGS:
            raise SpecError(
                f"{path}.args must not set {arg.split('=', 1)[0]}: the operator renders it "
                f"from the spec (reserved: {', '.join(RESERVED_FLAGS)})"
            )
    drain = flag_value(args, DRAIN_TIMEOUT_FLAG)
    if (drain is None and DRAIN_TIMEOUT_FLAG in args) or (
        drain is not None and not (drain.isascii() and drain.isdigit() and int(drain) <= 86400)
    ):
        raise SpecError(
            f"{path}.args {DRAIN_TIMEOUT_FLAG} must be followed by whole seconds in "
            f"[0, 86400] (the pod's termination grace period is derived from it), got {drain!r}"
        )
    env = tuple(field_value(raw, "env", path, list, []))
    for item in env:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise SpecError(f"{path}.env items must be objects with a string 'name', got {item!r}")
        if item["name"] in RESERVED_ENV:
            raise SpecError(
                f"{path}.env must not set {item['name']} (reserved: {', '.join(RESERVED_ENV)})"
            )
    resources = field_value(raw, "resources", path, dict, {})
    for section in ("limits", "requests"):
        if GPU_RESOURCE in (resources.get(section) or {}):
            raise SpecError(
                f"{path}.resources.{section} must not set {GPU_RESOURCE}: "
                "GPUs come from spec.parallelism.gpusPerPod"
            )
    spec_raw = field_value(raw, "speculative", path, dict)
    speculative = None
    if spec_raw is not None:
        spath = f"{path}.speculative"
        algorithm = one_of(spec_raw, "algorithm", spath, "", SPECULATIVE_ALGORITHMS)
        speculative = SpeculativeSpec(
            algorithm=algorithm,
            num_draft_tokens=int_in(spec_raw, "numDraftTokens", spath, 5, 2, 16),
            draft_model_path=parse_draft_model(spec_raw, spath, algorithm),
        )
    return RuntimeSpec(
        image=image,
        image_pull_policy=one_of(raw, "imagePullPolicy", path, "IfNotPresent", PULL_POLICIES),
        dtype=one_of(raw, "dtype", path, "auto", DTYPES),
        kv_cache_dtype=one_of(raw, "kvCacheDtype", path, "auto", KV_CACHE_DTYPES),
        quantization=one_of(raw, "quantization", path, "auto", QUANTIZATION_MODES),
        mem_fraction_static=float(fraction),
        max_total_tokens=int_in(raw, "maxTotalTokens", path, None, 1, 2**31 - 1),
        cuda_graph=cuda_graph,
        args=args,
        env=env,
        resources=resources,
        startup_timeout_seconds=int_in(raw, "startupTimeoutSeconds", path, 1800, 10, 86400),
        speculative=speculative,
    )


def parse_weight_update(raw: Mapping[str, Any]) -> WeightUpdateSpec:
    """Parse ``spec.weightUpdate``. Raises :class:`SpecError`."""
    path = "spec.weightUpdate"
    canary_raw = field_value(raw, "canary", path, dict)
    canary = None
    if canary_raw is not None and field_value(canary_raw, "enabled", f"{path}.canary", bool, True):
        verify_raw = field_value(canary_raw, "verify", f"{path}.canary", dict)
        verify = None
        if verify_raw is not None:
            vpath = f"{path}.canary.verify"
            prompt = field_value(verify_raw, "prompt", vpath, str, required=True)
            if not prompt.strip() or len(prompt) > 4096:
                raise SpecError(
                    f"{vpath}.prompt must be a non-empty string of at most 4096 characters"
                )
            latency = field_value(verify_raw, "maxLatencySeconds", vpath, (int, float), 10)
            if not 0 < float(latency) <= 600:
                raise SpecError(f"{vpath}.maxLatencySeconds must be in (0, 600], got {latency}")
            verify = VerifySpec(
                prompt, int_in(verify_raw, "maxTokens", vpath, 8, 1, 256), float(latency)
            )
        canary = CanarySpec(verify)
    strategy = one_of(raw, "strategy", path, "InPlace", STRATEGIES)
    if canary_raw is not None and strategy != "InPlace":
        raise SpecError(f"{path}.canary applies to strategy InPlace only, got strategy {strategy}")
    return WeightUpdateSpec(
        strategy=strategy,
        timeout_seconds=int_in(raw, "timeoutSeconds", path, 900, 1, 86400),
        rollback_on_failure=field_value(raw, "rollbackOnFailure", path, bool, True),
        max_unavailable=int_in(raw, "maxUnavailable", path, 1, 1, MAX_REPLICAS),
        pause_seconds=int_in(raw, "pauseSeconds", path, 0, 0, 86400),
        canary=canary,
    )


def parse_auth(raw: Mapping[str, Any]) -> AuthSpec:
    """Parse ``spec.auth``. Raises :class:`SpecError`."""
    ref = field_value(raw, "apiKeySecretRef", "spec.auth", dict)
    if ref is None:
        return AuthSpec()
    path = "spec.auth.apiKeySecretRef"
    name = field_value(ref, "name", path, str, required=True)
    key = field_value(ref, "key", path, str, "api-key")
    if len(name) > 253 or not _SECRET_NAME.match(name):
        raise SpecError(
            f"{path}.name must be a Secret name (lowercase letters, digits, '-', '.'; "
            f"at most 253 characters), got {name!r}"
        )
    if len(key) > 253 or not _SECRET_KEY.match(key):
        raise SpecError(f"{path}.key must be a Secret data key ([-._a-zA-Z0-9]+), got {key!r}")
    return AuthSpec(api_key_secret=SecretKeyRef(name=name, key=key))


def parse_network_policy(raw: Mapping[str, Any]) -> NetworkPolicySpec:
    """Parse ``spec.networkPolicy``. Raises :class:`SpecError`."""
    path = "spec.networkPolicy"
    namespaces = field_value(raw, "allowedNamespaces", path, list, [])
    for namespace in namespaces:
        if not isinstance(namespace, str) or len(namespace) > 63 or not _NAMESPACE.match(namespace):
            raise SpecError(
                f"{path}.allowedNamespaces items must be namespace names (DNS-1123 labels), "
                f"got {namespace!r}"
            )
    return NetworkPolicySpec(
        enabled=field_value(raw, "enabled", path, bool, True),
        allowed_namespaces=tuple(dict.fromkeys(namespaces)),
    )


def parse_spec(name: str, namespace: str, uid: str, spec: Mapping[str, Any]) -> DeploymentSpec:
    """Validate ``spec`` of the object ``namespace/name`` into a :class:`DeploymentSpec`.

    Raises:
        SpecError: naming the first invalid field, its value and the allowed values.
    """
    if len(name) > MAX_NAME_LENGTH or not _DNS_LABEL.match(name):
        raise SpecError(
            f"metadata.name must be a DNS-1035 label of at most {MAX_NAME_LENGTH} characters "
            f"(lowercase letters, digits, '-'; starting with a letter), got {name!r}"
        )
    if not isinstance(spec, Mapping):
        raise SpecError(f"spec must be an object, got {type(spec).__name__}")
    parallelism = parse_parallelism(field_value(spec, "parallelism", "spec", dict, {}))
    update_raw = field_value(spec, "weightUpdate", "spec", dict, {})
    restart_raw = field_value(spec, "restartPolicy", "spec", dict, {})
    sched_raw = field_value(spec, "scheduling", "spec", dict, {})
    service_raw = field_value(spec, "service", "spec", dict, {})
    if parallelism.pipeline > 1 and field_value(spec, "loraAdapters", "spec", list, []):
        raise SpecError(
            f"spec.loraAdapters are not served with spec.parallelism.pipeline > 1 (got pipeline "
            f"{parallelism.pipeline}); use pipeline 1 or remove the adapters"
        )
    speculative = field_value(
        field_value(spec, "runtime", "spec", dict, {}), "speculative", "spec.runtime", dict
    )
    if speculative is not None and (
        parallelism.pipeline > 1 or field_value(spec, "loraAdapters", "spec", list, [])
    ):
        raise SpecError(
            "spec.runtime.speculative is not served with spec.parallelism.pipeline > 1 or "
            "spec.loraAdapters; remove one of them"
        )
    model = parse_model(field_value(spec, "model", "spec", dict, required=True))
    shared_cache = "persistentVolumeClaim" in (model.cache_volume or {})
    if model.is_remote and parallelism.pods_per_group > 1 and not shared_cache:
        # The leader fetches an update's revision; the other pods must read the same directory.
        raise SpecError(
            "spec.model.cache.volume must be a shared (ReadWriteMany) persistentVolumeClaim when "
            f"an hf:// or s3:// spec.model.uri serves groups of {parallelism.pods_per_group} pods"
        )
    runtime = parse_runtime(field_value(spec, "runtime", "spec", dict, required=True))
    check_draft_source(runtime.speculative, model)
    return DeploymentSpec(
        name=name,
        namespace=namespace,
        uid=uid,
        replicas=int_in(spec, "replicas", "spec", 1, 0, MAX_REPLICAS),
        model=model,
        parallelism=parallelism,
        runtime=runtime,
        weight_update=parse_weight_update(update_raw),
        restart_policy=RestartPolicySpec(
            max_group_restarts=int_in(
                restart_raw, "maxGroupRestarts", "spec.restartPolicy", 5, 0, 1000
            ),
            backoff_seconds=int_in(
                restart_raw, "backoffSeconds", "spec.restartPolicy", 10, 1, 3600
            ),
        ),
        scheduling=SchedulingSpec(
            node_selector=field_value(sched_raw, "nodeSelector", "spec.scheduling", dict, {}),
            tolerations=tuple(field_value(sched_raw, "tolerations", "spec.scheduling", list, [])),
            affinity=field_value(sched_raw, "affinity", "spec.scheduling", dict),
            priority_class_name=field_value(sched_raw, "priorityClassName", "spec.scheduling", str),
        ),
        service=ServiceSpec(
            type=one_of(service_raw, "type", "spec.service", "ClusterIP", SERVICE_TYPES),
            port=int_in(service_raw, "port", "spec.service", 8000, 1, 65535),
        ),
        lora_adapters=parse_lora_adapters(
            field_value(spec, "loraAdapters", "spec", list, []),
            _max_loras_per_batch(field_value(spec, "runtime", "spec", dict, {})),
        ),
        auth=parse_auth(field_value(spec, "auth", "spec", dict, {})),
        network_policy=parse_network_policy(field_value(spec, "networkPolicy", "spec", dict, {})),
    )


def parse_parallelism(raw: Mapping[str, Any]) -> ParallelismSpec:
    """Parse ``spec.parallelism`` (see ``parallelism.py`` for the rank layout). Raises :class:`SpecError`."""
    path = "spec.parallelism"
    partition = field_value(raw, "pipelineLayerPartition", path, list, [])
    # present but empty is refused, as the CRD's CEL rule does (size must equal pipeline)
    if ("pipelineLayerPartition" in raw and not partition) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in partition
    ):
        raise SpecError(
            f"{path}.pipelineLayerPartition must be a list of layer counts >= 1 (one per stage), "
            f"got {partition!r}"
        )
    parallelism = ParallelismSpec(
        tensor=int_in(raw, "tensor", path, 1, 1, MAX_WORLD_SIZE),
        gpus_per_pod=int_in(raw, "gpusPerPod", path, 1, 1, 64),
        expert=int_in(raw, "expert", path, 1, 1, MAX_WORLD_SIZE),
        pipeline=int_in(raw, "pipeline", path, 1, 1, MAX_PIPELINE),
        pipeline_layer_partition=tuple(partition),
    )
    error = parallelism.layout_error()
    if error is not None:
        raise SpecError(f"{path}: {error}")
    return parallelism


def _max_loras_per_batch(runtime_raw: Mapping[str, Any]) -> int:
    args = [str(a) for a in runtime_raw.get("args") or []]
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key == "--max-loras-per-batch":
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            return int(value) if value.isdigit() else DEFAULT_MAX_LORAS_PER_BATCH
    return DEFAULT_MAX_LORAS_PER_BATCH


def parse_lora_adapters(raw: list, max_loaded: int) -> tuple[LoRAAdapterSpec, ...]:
    """Parse ``spec.loraAdapters``: unique names (the OpenAI ``model`` a client sends),
    absolute paths, at most ``max_loaded`` (the runtime's ``--max-loras-per-batch``).
    Raises :class:`SpecError`."""
    out: list[LoRAAdapterSpec] = []
    for i, item in enumerate(raw):
        path = f"spec.loraAdapters[{i}]"
        if not isinstance(item, Mapping):
            raise SpecError(f"{path} must be an object with name and path")
        name = field_value(item, "name", path, str, required=True)
        adapter_path = field_value(item, "path", path, str, required=True)
        if not _LABEL_VALUE.match(name):
            raise SpecError(
                f"{path}.name must be 1-63 characters [A-Za-z0-9._-], starting and ending alphanumeric, got {name!r}"
            )
        if not posixpath.isabs(adapter_path):
            raise SpecError(
                f"{path}.path must be an absolute directory path in the pod, got {adapter_path!r}"
            )
        if any(a.name == name for a in out):
            raise SpecError(f"{path}.name {name!r} is repeated; adapter names must be unique")
        out.append(LoRAAdapterSpec(name=name, path=adapter_path))
    if len(out) > max_loaded:
        raise SpecError(
            f"spec.loraAdapters has {len(out)} adapters but the runtime holds {max_loaded} at once "
            "(--max-loras-per-batch in spec.runtime.args)"
        )
    return tuple(out)
