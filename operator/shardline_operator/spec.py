"""Parse and validate ``InferenceDeployment.spec`` into frozen dataclasses.

The CRD schema (``crds/inferencedeployment.yaml``) rejects most bad input at the API server;
this module repeats those checks (the operator must also be safe against objects created
before a schema change, and unit tests run without an API server) and adds what a schema
cannot express. Defaults here equal the CRD defaults. Every error names the field path and the
allowed values: ``SpecError("spec.parallelism: tensor (3) must be a multiple of gpusPerPod (2)")``.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, overload

from .parallelism import MAX_PIPELINE, MAX_WORLD_SIZE, ParallelismSpec

DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = (
    "auto",
    "bfloat16",
    "float16",
    "fp8_e4m3",
    "fp8_e5m2",
)  # the runtime's --kv-cache-dtype
STRATEGIES = ("InPlace", "Restart")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
MAX_NAME_LENGTH = 40  # "<name>-g99-ranks" and the pods' controller-revision-hash label stay <= 63
MAX_REPLICAS = 100
# Flags the operator renders itself; a user repeating one in runtime.args would contradict it.
RESERVED_FLAGS = (
    "--model-path",
    "--served-model-name",
    "--revision",
    "--host",
    "--port",
    "--tp-size",
    "--nnodes",
    "--node-rank",
    "--dist-init-addr",
    "--dtype",
    "--mem-fraction-static",
    "--max-total-tokens",
    "--cuda-graph-max-bs",
    "--disable-cuda-graph",
    "--ep-size",
    "--api-key",
    "--admin-api-key",
    "--kv-cache-dtype",
    "--lora-paths",
    "--pp-size",
    "--pp-layer-partition",
)
DEFAULT_MAX_LORAS_PER_BATCH = 8  # the runtime's --max-loras-per-batch default
# The keys reach the runtime only through these env vars, filled from Secrets (spec.auth).
API_KEY_ENV = "SHARDLINE_API_KEY"
ADMIN_API_KEY_ENV = "SHARDLINE_ADMIN_API_KEY"
RESERVED_ENV = ("POD_IP", "POD_NAME", "POD_NAMESPACE", "POD_INDEX", API_KEY_ENV, ADMIN_API_KEY_ENV)
GPU_RESOURCE = "nvidia.com/gpu"
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z]([a-z0-9-]*[a-z0-9])?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


class SpecError(ValueError):
    """The spec is invalid; the message names the field path and the allowed values."""


@dataclass(frozen=True)
class ModelSpec:
    """``spec.model``: ``name`` is the OpenAI model name, ``path`` an absolute directory in the pod."""

    name: str
    path: str
    revision: str
    mount_path: str
    volume: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class CudaGraphSpec:
    """``spec.runtime.cudaGraph``: decode graphs for batch sizes up to ``max_batch_size``."""

    enabled: bool = True
    max_batch_size: int = 160

    def key(self) -> str:
        """Stable text form stored in an annotation, e.g. ``enabled=true,maxBatchSize=160``."""
        return f"enabled={str(self.enabled).lower()},maxBatchSize={self.max_batch_size}"


@dataclass(frozen=True)
class RuntimeSpec:
    """``spec.runtime``: container image and runtime flags; times in seconds."""

    image: str
    image_pull_policy: str = "IfNotPresent"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    cuda_graph: CudaGraphSpec = field(default_factory=CudaGraphSpec)
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    resources: Mapping[str, Any] = field(default_factory=dict)
    startup_timeout_seconds: int = 1800


@dataclass(frozen=True)
class VerifySpec:
    """``spec.weightUpdate.canary.verify``: a completion the canary must answer with HTTP 200
    within ``max_latency_seconds`` (``max_tokens`` greedy tokens of ``prompt``)."""

    prompt: str
    max_tokens: int = 8
    max_latency_seconds: float = 10.0


@dataclass(frozen=True)
class CanarySpec:
    """``spec.weightUpdate.canary``: the first group updates alone and must pass
    ``/health_generate`` (and ``verify``, if given) before the others follow."""

    verify: VerifySpec | None = None


@dataclass(frozen=True)
class WeightUpdateSpec:
    """``spec.weightUpdate``: how a ``spec.model`` change reaches running groups.

    ``max_unavailable``: groups updating at once (a wave); ``pause_seconds``: wait between
    waves; ``canary``: None, or the gate after the first group.
    """

    strategy: str = "InPlace"
    timeout_seconds: int = 900
    rollback_on_failure: bool = True
    max_unavailable: int = 1
    pause_seconds: int = 0
    canary: CanarySpec | None = None


@dataclass(frozen=True)
class RestartPolicySpec:
    """``spec.restartPolicy``: whole-group restarts allowed, and the first backoff (seconds)."""

    max_group_restarts: int = 5
    backoff_seconds: int = 10


@dataclass(frozen=True)
class SchedulingSpec:
    """``spec.scheduling``: copied into the pod spec as is."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None
    priority_class_name: str | None = None


@dataclass(frozen=True)
class ServiceSpec:
    """``spec.service``: the client Service over the group leaders."""

    type: str = "ClusterIP"
    port: int = 8000


@dataclass(frozen=True)
class LoRAAdapterSpec:
    """One ``spec.loraAdapters`` entry: served ``name`` and adapter directory ``path`` in the pod."""

    name: str
    path: str


@dataclass(frozen=True)
class SecretKeyRef:
    """A key of a Secret in the deployment's namespace."""

    name: str
    key: str


@dataclass(frozen=True)
class AuthSpec:
    """``spec.auth``: where the serving API key lives (None: serving endpoints are open)."""

    api_key_secret: SecretKeyRef | None = None


@dataclass(frozen=True)
class NetworkPolicySpec:
    """``spec.networkPolicy``: render one NetworkPolicy per group; extra client namespaces."""

    enabled: bool = True
    allowed_namespaces: tuple[str, ...] = ()


@dataclass(frozen=True)
class DeploymentSpec:
    """A validated ``InferenceDeployment``: identity (name, namespace, uid) plus its spec."""

    name: str
    namespace: str
    uid: str
    replicas: int
    model: ModelSpec
    parallelism: ParallelismSpec
    runtime: RuntimeSpec
    weight_update: WeightUpdateSpec = field(default_factory=WeightUpdateSpec)
    restart_policy: RestartPolicySpec = field(default_factory=RestartPolicySpec)
    scheduling: SchedulingSpec = field(default_factory=SchedulingSpec)
    service: ServiceSpec = field(default_factory=ServiceSpec)
    lora_adapters: tuple[LoRAAdapterSpec, ...] = ()
    auth: AuthSpec = field(default_factory=AuthSpec)
    network_policy: NetworkPolicySpec = field(default_factory=NetworkPolicySpec)
    # Not in the CR: a digest of the keys' current values, filled in by the reconciler after it
    # read the Secrets, so that a rotated key changes the restart hash (pods read keys at start).
    credentials_digest: str = ""

    def restart_hash(self) -> str:
        """Hash (12 hex chars) of every field whose change needs a pod restart.

        Excluded: ``model.path``/``model.revision`` (rolled in place with ``InPlace``),
        ``runtime.cudaGraph`` (recaptured in place), replicas, weightUpdate, restartPolicy,
        service and networkPolicy (they never touch a running pod). Included: ``auth`` and the
        digest of the keys' values, which the runtime reads once at start.
        """
        relevant: dict[str, Any] = {
            "modelName": self.model.name,
            "mountPath": self.model.mount_path,
            "volume": self.model.volume,
            "parallelism": self.parallelism.restart_fields(),
            "runtime": {k: v for k, v in asdict(self.runtime).items() if k != "cuda_graph"},
            "scheduling": asdict(self.scheduling),
        }
        if self.lora_adapters:  # --enable-lora needs a restart; adding/removing adapters does not
            relevant["lora"] = True
        if self.auth.api_key_secret is not None or self.credentials_digest:
            # The reconciler always sets the digest; a spec rendered without it (tests) keeps its old hash.
            relevant["auth"] = {"apiKey": asdict(self.auth), "digest": self.credentials_digest}
        text = json.dumps(relevant, sort_keys=True, default=list)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _get(
    obj: Mapping[str, Any],
    key: str,
    path: str,
    kind: type | tuple[type, ...],
    default: Any = None,
    required: bool = False,
) -> Any:
    value = obj.get(key, default)
    if value is None:
        if required:
            raise SpecError(f"{path}.{key} is required")
        return default
    # bool is an int subclass: never accept True where a number is meant.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise SpecError(
            f"{path}.{key} must be of type {_type_names(kind)}, got {type(value).__name__} {value!r}"
        )
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _type_names(kind: type | tuple[type, ...]) -> str:
    names = {
        int: "integer",
        float: "number",
        str: "string",
        bool: "boolean",
        dict: "object",
        list: "array",
    }
    return " or ".join(names.get(k, k.__name__) for k in _as_tuple(kind))


@overload
def _int_in(
    obj: Mapping[str, Any],
    key: str,
    path: str,
    default: int,
    low: int,
    high: int,
    required: bool = False,
) -> int: ...
@overload
def _int_in(
    obj: Mapping[str, Any],
    key: str,
    path: str,
    default: None,
    low: int,
    high: int,
    required: bool = False,
) -> int | None: ...
def _int_in(
    obj: Mapping[str, Any],
    key: str,
    path: str,
    default: int | None,
    low: int,
    high: int,
    required: bool = False,
) -> int | None:
    value = _get(obj, key, path, int, default, required)
    if value is not None and not low <= value <= high:
        raise SpecError(f"{path}.{key} must be in [{low}, {high}], got {value}")
    return value


def _one_of(
    obj: Mapping[str, Any], key: str, path: str, default: str, allowed: tuple[str, ...]
) -> str:
    value = _get(obj, key, path, str, default)
    if value not in allowed:
        raise SpecError(f"{path}.{key} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def parse_model(raw: Mapping[str, Any]) -> ModelSpec:
    """Parse ``spec.model``. Raises :class:`SpecError`."""
    path = "spec.model"
    name = _get(raw, "name", path, str, required=True)
    model_path = _get(raw, "path", path, str, required=True)
    if not name.strip():
        raise SpecError(f"{path}.name must be a non-empty string")
    if not posixpath.isabs(model_path):
        raise SpecError(
            f"{path}.path must be an absolute directory path in the pod, got {model_path!r}"
        )
    revision = _get(raw, "revision", path, str, posixpath.basename(posixpath.normpath(model_path)))
    if not _LABEL_VALUE.match(revision):
        raise SpecError(
            f"{path}.revision must be 1-63 characters [A-Za-z0-9._-], starting and ending "
            f"alphanumeric (it becomes a label value), got {revision!r}"
        )
    mount_path = _get(raw, "mountPath", path, str, "/var/lib/shardline/models")
    volume = _get(raw, "volume", path, dict)
    if volume is not None:
        if len(volume) != 1:
            raise SpecError(
                f"{path}.volume must hold exactly one volume source (e.g. hostPath, "
                f"persistentVolumeClaim), got {sorted(volume)}"
            )
        inside = posixpath.normpath(model_path).startswith(
            posixpath.normpath(mount_path).rstrip("/") + "/"
        )
        if not inside:
            raise SpecError(
                f"{path}.path ({model_path}) must be inside {path}.mountPath ({mount_path}) "
                "where the volume is mounted"
            )
    return ModelSpec(
        name=name, path=model_path, revision=revision, mount_path=mount_path, volume=volume
    )


def parse_runtime(raw: Mapping[str, Any]) -> RuntimeSpec:
    """Parse ``spec.runtime``. Raises :class:`SpecError`."""
    path = "spec.runtime"
    image = _get(raw, "image", path, str, required=True)
    if not image.strip():
        raise SpecError(f"{path}.image must be a non-empty image reference")
    fraction = _get(raw, "memFractionStatic", path, (int, float), 0.85)
    if not 0.0 < float(fraction) <= 1.0:
        raise SpecError(f"{path}.memFractionStatic must be in (0, 1], got {fraction}")
    graph_raw = _get(raw, "cudaGraph", path, dict, {})
    cuda_graph = CudaGraphSpec(
        enabled=_get(graph_raw, "enabled", f"{path}.cudaGraph", bool, True),
        max_batch_size=_int_in(graph_raw, "maxBatchSize", f"{path}.cudaGraph", 160, 1, 4096),
    )
    args = tuple(_get(raw, "args", path, list, []))
    for arg in args:
        if not isinstance(arg, str):
            raise SpecError(f"{path}.args must be a list of strings, got {arg!r}")
        if arg.split("=", 1)[0] in RESERVED_FLAGS:
            raise SpecError(
                f"{path}.args must not set {arg.split('=', 1)[0]}: the operator renders it "
                f"from the spec (reserved: {', '.join(RESERVED_FLAGS)})"
            )
    env = tuple(_get(raw, "env", path, list, []))
    for item in env:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise SpecError(f"{path}.env items must be objects with a string 'name', got {item!r}")
        if item["name"] in RESERVED_ENV:
            raise SpecError(
                f"{path}.env must not set {item['name']} (reserved: {', '.join(RESERVED_ENV)})"
            )
    resources = _get(raw, "resources", path, dict, {})
    for section in ("limits", "requests"):
        if GPU_RESOURCE in (resources.get(section) or {}):
            raise SpecError(
                f"{path}.resources.{section} must not set {GPU_RESOURCE}: "
                "GPUs come from spec.parallelism.gpusPerPod"
            )
    return RuntimeSpec(
        image=image,
        image_pull_policy=_one_of(raw, "imagePullPolicy", path, "IfNotPresent", PULL_POLICIES),
        dtype=_one_of(raw, "dtype", path, "auto", DTYPES),
        kv_cache_dtype=_one_of(raw, "kvCacheDtype", path, "auto", KV_CACHE_DTYPES),
        mem_fraction_static=float(fraction),
        max_total_tokens=_int_in(raw, "maxTotalTokens", path, None, 1, 2**31 - 1),
        cuda_graph=cuda_graph,
        args=args,
        env=env,
        resources=resources,
        startup_timeout_seconds=_int_in(raw, "startupTimeoutSeconds", path, 1800, 10, 86400),
    )


def parse_weight_update(raw: Mapping[str, Any]) -> WeightUpdateSpec:
    """Parse ``spec.weightUpdate``. Raises :class:`SpecError`."""
    path = "spec.weightUpdate"
    canary_raw = _get(raw, "canary", path, dict)
    canary = None
    if canary_raw is not None and _get(canary_raw, "enabled", f"{path}.canary", bool, True):
        verify_raw = _get(canary_raw, "verify", f"{path}.canary", dict)
        verify = None
        if verify_raw is not None:
            vpath = f"{path}.canary.verify"
            prompt = _get(verify_raw, "prompt", vpath, str, required=True)
            if not prompt.strip() or len(prompt) > 4096:
                raise SpecError(
                    f"{vpath}.prompt must be a non-empty string of at most 4096 characters"
                )
            latency = _get(verify_raw, "maxLatencySeconds", vpath, (int, float), 10)
            if not 0 < float(latency) <= 600:
                raise SpecError(f"{vpath}.maxLatencySeconds must be in (0, 600], got {latency}")
            verify = VerifySpec(
                prompt, _int_in(verify_raw, "maxTokens", vpath, 8, 1, 256), float(latency)
            )
        canary = CanarySpec(verify)
    strategy = _one_of(raw, "strategy", path, "InPlace", STRATEGIES)
    if canary_raw is not None and strategy != "InPlace":
        raise SpecError(f"{path}.canary applies to strategy InPlace only, got strategy {strategy}")
    return WeightUpdateSpec(
        strategy=strategy,
        timeout_seconds=_int_in(raw, "timeoutSeconds", path, 900, 1, 86400),
        rollback_on_failure=_get(raw, "rollbackOnFailure", path, bool, True),
        max_unavailable=_int_in(raw, "maxUnavailable", path, 1, 1, MAX_REPLICAS),
        pause_seconds=_int_in(raw, "pauseSeconds", path, 0, 0, 86400),
        canary=canary,
    )


def parse_auth(raw: Mapping[str, Any]) -> AuthSpec:
    """Parse ``spec.auth``. Raises :class:`SpecError`."""
    ref = _get(raw, "apiKeySecretRef", "spec.auth", dict)
    if ref is None:
        return AuthSpec()
    path = "spec.auth.apiKeySecretRef"
    name = _get(ref, "name", path, str, required=True)
    key = _get(ref, "key", path, str, "api-key")
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
    namespaces = _get(raw, "allowedNamespaces", path, list, [])
    for namespace in namespaces:
        if not isinstance(namespace, str) or len(namespace) > 63 or not _NAMESPACE.match(namespace):
            raise SpecError(
                f"{path}.allowedNamespaces items must be namespace names (DNS-1123 labels), "
                f"got {namespace!r}"
            )
    return NetworkPolicySpec(
        enabled=_get(raw, "enabled", path, bool, True),
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
    parallelism = parse_parallelism(_get(spec, "parallelism", "spec", dict, {}))
    update_raw = _get(spec, "weightUpdate", "spec", dict, {})
    restart_raw = _get(spec, "restartPolicy", "spec", dict, {})
    sched_raw = _get(spec, "scheduling", "spec", dict, {})
    service_raw = _get(spec, "service", "spec", dict, {})
    if parallelism.pipeline > 1 and _get(spec, "loraAdapters", "spec", list, []):
        raise SpecError(
            f"spec.loraAdapters are not served with spec.parallelism.pipeline > 1 (got pipeline "
            f"{parallelism.pipeline}); use pipeline 1 or remove the adapters"
        )
    return DeploymentSpec(
        name=name,
        namespace=namespace,
        uid=uid,
        replicas=_int_in(spec, "replicas", "spec", 1, 0, MAX_REPLICAS),
        model=parse_model(_get(spec, "model", "spec", dict, required=True)),
        parallelism=parallelism,
        runtime=parse_runtime(_get(spec, "runtime", "spec", dict, required=True)),
        weight_update=parse_weight_update(update_raw),
        restart_policy=RestartPolicySpec(
            max_group_restarts=_int_in(
                restart_raw, "maxGroupRestarts", "spec.restartPolicy", 5, 0, 1000
            ),
            backoff_seconds=_int_in(
                restart_raw, "backoffSeconds", "spec.restartPolicy", 10, 1, 3600
            ),
        ),
        scheduling=SchedulingSpec(
            node_selector=_get(sched_raw, "nodeSelector", "spec.scheduling", dict, {}),
            tolerations=tuple(_get(sched_raw, "tolerations", "spec.scheduling", list, [])),
            affinity=_get(sched_raw, "affinity", "spec.scheduling", dict),
            priority_class_name=_get(sched_raw, "priorityClassName", "spec.scheduling", str),
        ),
        service=ServiceSpec(
            type=_one_of(service_raw, "type", "spec.service", "ClusterIP", SERVICE_TYPES),
            port=_int_in(service_raw, "port", "spec.service", 8000, 1, 65535),
        ),
        lora_adapters=parse_lora_adapters(
            _get(spec, "loraAdapters", "spec", list, []),
            _max_loras_per_batch(_get(spec, "runtime", "spec", dict, {})),
        ),
        auth=parse_auth(_get(spec, "auth", "spec", dict, {})),
        network_policy=parse_network_policy(_get(spec, "networkPolicy", "spec", dict, {})),
    )


def parse_parallelism(raw: Mapping[str, Any]) -> ParallelismSpec:
    """Parse ``spec.parallelism`` (see ``parallelism.py`` for the rank layout). Raises :class:`SpecError`."""
    path = "spec.parallelism"
    partition = _get(raw, "pipelineLayerPartition", path, list, [])
    # present but empty is refused, as the CRD's CEL rule does (size must equal pipeline)
    if ("pipelineLayerPartition" in raw and not partition) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in partition
    ):
        raise SpecError(
            f"{path}.pipelineLayerPartition must be a list of layer counts >= 1 (one per stage), "
            f"got {partition!r}"
        )
    parallelism = ParallelismSpec(
        tensor=_int_in(raw, "tensor", path, 1, 1, MAX_WORLD_SIZE),
        gpus_per_pod=_int_in(raw, "gpusPerPod", path, 1, 1, 64),
        expert=_int_in(raw, "expert", path, 1, 1, MAX_WORLD_SIZE),
        pipeline=_int_in(raw, "pipeline", path, 1, 1, MAX_PIPELINE),
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
        name = _get(item, "name", path, str, required=True)
        adapter_path = _get(item, "path", path, str, required=True)
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
