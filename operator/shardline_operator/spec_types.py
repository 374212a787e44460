"""The parsed ``InferenceDeployment.spec``: frozen dataclasses, and the constants the CRD
schema shares (``tests/operator/test_crd_schema.py`` checks the two agree). ``spec.py`` parses
raw specs into these."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .parallelism import ParallelismSpec

DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = (
    "auto",
    "bfloat16",
    "float16",
    "fp8_e4m3",
    "fp8_e5m2",
)  # the runtime's --kv-cache-dtype
# the runtime's --quantization: auto reads the checkpoint's quantization_config; fp8 quantizes a
# bf16 checkpoint to FP8 per channel at load and at every weight update
QUANTIZATION_MODES = ("auto", "fp8")
# the runtime's --model-kind: generate (a causal LM), embed (an embedding model), auto: whichever
# the checkpoint is (the runtime refuses to start on a checkpoint of the other declared kind)
MODEL_KINDS = ("auto", "generate", "embed")
STRATEGIES = ("InPlace", "Restart")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
MAX_NAME_LENGTH = 40  # "<name>-g99-ranks" and the pods' controller-revision-hash label stay <= 63
MAX_REPLICAS = 100
# The runtime's SIGTERM drain when ``runtime.args`` has no ``--drain-timeout`` (its default,
# ``ServerArgs.drain_timeout``; tests/contract checks the two agree).
RUNTIME_DRAIN_TIMEOUT_SECONDS = 30
DRAIN_TIMEOUT_FLAG = "--drain-timeout"
# Flags the operator renders itself; a user repeating one in runtime.args would contradict it.
RESERVED_FLAGS = (
    "--model-path",
    "--download-dir",
    "--download-max-bytes",
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
    "--quantization",
    "--model-kind",
    "--lora-paths",
    "--pp-size",
    "--pp-layer-partition",
    "--speculative-algorithm",
    "--speculative-num-draft-tokens",
    "--speculative-draft-model-path",
)
# speculative decoding algorithms the runtime implements (its --speculative-algorithm)
SPECULATIVE_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")
DRAFT_MODEL_ALGORITHMS = (
    "STANDALONE",
    "EAGLE",
    "EAGLE3",
)  # those that need spec.runtime.speculative.draftModel
DEFAULT_MAX_LORAS_PER_BATCH = 8  # the runtime's --max-loras-per-batch default
# The keys reach the runtime only through these env vars, filled from Secrets (spec.auth).
API_KEY_ENV = "SHARDLINE_API_KEY"
ADMIN_API_KEY_ENV = "SHARDLINE_ADMIN_API_KEY"
RESERVED_ENV = ("POD_IP", "POD_NAME", "POD_NAMESPACE", "POD_INDEX", API_KEY_ENV, ADMIN_API_KEY_ENV)
GPU_RESOURCE = "nvidia.com/gpu"


class SpecError(ValueError):
    """The spec is invalid; the message names the field path and the allowed values."""


@dataclass(frozen=True)
class ModelSpec:
    """``spec.model``: ``name`` is the OpenAI model name; ``path`` an absolute directory in the
    pod, or for an ``hf://`` / ``s3://`` ``uri`` the uri itself (the runtime fetches it into the
    model cache volume; see ``spec_model.py``). A ``pvc://`` uri becomes ``volume`` + ``path``.
    ``cache_max_bytes`` 0: no eviction bound. ``kind``: what the deployment serves
    (``MODEL_KINDS``; ``auto``: whatever the checkpoint is)."""

    name: str
    path: str
    revision: str
    mount_path: str
    volume: Mapping[str, Any] | None = None
    uri: str | None = None
    s3_endpoint: str | None = None
    s3_region: str | None = None
    credentials_secret: str | None = None
    cache_volume: Mapping[str, Any] | None = None
    cache_max_bytes: int = 0
    kind: str = "auto"

    @property
    def is_remote(self) -> bool:
        """True for an ``hf://`` or ``s3://`` uri (fetched by the runtime, not mounted)."""
        return self.uri is not None and not self.uri.startswith("pvc://")


@dataclass(frozen=True)
class CudaGraphSpec:
    """``spec.runtime.cudaGraph``: decode graphs for batch sizes up to ``max_batch_size``."""

    enabled: bool = True
    max_batch_size: int = 160

    def key(self) -> str:
        """Stable text form stored in an annotation, e.g. ``enabled=true,maxBatchSize=160``."""
        return f"enabled={str(self.enabled).lower()},maxBatchSize={self.max_batch_size}"


@dataclass(frozen=True)
class SpeculativeSpec:
    """``spec.runtime.speculative``: the runtime's ``--speculative-algorithm`` and
    ``--speculative-num-draft-tokens`` (tokens one verify forward scores per request), and for
    a draft-model algorithm ``--speculative-draft-model-path`` (``draftModel.path``, a directory
    on ``spec.model``'s volume)."""

    algorithm: str
    num_draft_tokens: int = 5
    draft_model_path: str | None = None


@dataclass(frozen=True)
class RuntimeSpec:
    """``spec.runtime``: container image and runtime flags; times in seconds."""

    image: str
    image_pull_policy: str = "IfNotPresent"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str = "auto"
    mem_fraction_static: float = 0.85
    max_total_tokens: int | None = None
    cuda_graph: CudaGraphSpec = field(default_factory=CudaGraphSpec)
    args: tuple[str, ...] = ()
    env: tuple[Mapping[str, Any], ...] = ()
    resources: Mapping[str, Any] = field(default_factory=dict)
    startup_timeout_seconds: int = 1800
    speculative: SpeculativeSpec | None = None

    def drain_timeout_seconds(self) -> int:
        """Seconds the runtime drains on SIGTERM: ``--drain-timeout`` from ``args`` (``N`` or
        ``=N``, validated by ``parse_runtime``), else :data:`RUNTIME_DRAIN_TIMEOUT_SECONDS`."""
        value = flag_value(self.args, DRAIN_TIMEOUT_FLAG)
        return RUNTIME_DRAIN_TIMEOUT_SECONDS if value is None else int(value)


def flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The last value given to ``flag`` in ``args`` (``flag N`` or ``flag=N``), None if absent
    or given without a value."""
    found = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


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

        Excluded: ``model.path``/``model.revision`` and ``runtime.speculative.draftModel``
        (rolled in place with ``InPlace``; the draft's ``algorithm`` and ``numDraftTokens`` are
        flags read at start and stay in), ``runtime.cudaGraph`` (recaptured in place), replicas, weightUpdate, restartPolicy,
        service and networkPolicy (they never touch a running pod). Included: ``auth`` and the
        digest of the keys' values, which the runtime reads once at start.
        """
        relevant: dict[str, Any] = {
            "modelName": self.model.name,
            "mountPath": self.model.mount_path,
            "volume": self.model.volume,
            "parallelism": self.parallelism.restart_fields(),
            "runtime": self._runtime_restart_fields(),
            "scheduling": asdict(self.scheduling),
        }
        if self.model.is_remote:  # the store's env, cache volume and bound are read at start
            relevant["modelStore"] = [
                self.model.s3_endpoint,
                self.model.s3_region,
                self.model.credentials_secret,
                self.model.cache_volume,
                self.model.cache_max_bytes,
            ]
        if self.lora_adapters:  # --enable-lora needs a restart; adding/removing adapters does not
            relevant["lora"] = True
        if self.auth.api_key_secret is not None or self.credentials_digest:
            # The reconciler always sets the digest; a spec rendered without it (tests) keeps its old hash.
            relevant["auth"] = {"apiKey": asdict(self.auth), "digest": self.credentials_digest}
        text = json.dumps(relevant, sort_keys=True, default=list)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def _runtime_restart_fields(self) -> dict[str, Any]:
        fields = {k: v for k, v in asdict(self.runtime).items() if k != "cuda_graph"}
        if fields.get("speculative"):  # the draft's source rolls in place (ServedModel.draft)
            fields["speculative"] = {
                k: v for k, v in fields["speculative"].items() if k != "draft_model_path"
            }
        return fields
