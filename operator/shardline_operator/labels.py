"""Names, labels and annotations: the one place that spells them.

Every child object of an ``InferenceDeployment`` carries the recommended
``app.kubernetes.io/*`` labels plus ``shardline.dev/{deployment,group,revision}``; selectors use
only the immutable subset (deployment and group), so a revision change never orphans pods.

Routing labels (``routing.py`` sets them on group leaders): ``shardline.dev/routable`` (every
routing path selects ``"true"``: the client Service, the per-revision Services, a gateway's
discovery), ``shardline.dev/served-revision`` and ``shardline.dev/weight-version`` (what the
leader reports it serves, never the spec).
"""

from __future__ import annotations

import hashlib
import re

API_GROUP = "shardline.dev"
API_VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
FIELD_MANAGER = "shardline-operator"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_PART_OF = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_DEPLOYMENT = "shardline.dev/deployment"
LABEL_GROUP = "shardline.dev/group"
LABEL_REVISION = "shardline.dev/revision"
LABEL_ROUTABLE = "shardline.dev/routable"
LABEL_SERVED_REVISION = "shardline.dev/served-revision"
LABEL_WEIGHT_VERSION = "shardline.dev/weight-version"
LABEL_REVISION_SERVICE = "shardline.dev/revision-service"  # marks a per-revision Service
LABEL_MODEL_KIND = "shardline.dev/model-kind"  # on the client Service when spec.model.kind is set
# Set by the StatefulSet controller on every pod (Kubernetes >= 1.28): the pod's ordinal = TP node rank.
LABEL_POD_INDEX = "apps.kubernetes.io/pod-index"

# On StatefulSets (and their pod templates): what the group runs, so the state survives an
# operator restart without a database.
ANNOTATION_RESTART_HASH = "shardline.dev/restart-hash"
ANNOTATION_MODEL_PATH = "shardline.dev/model-path"
ANNOTATION_MODEL_REVISION = "shardline.dev/model-revision"
ANNOTATION_CUDA_GRAPH = "shardline.dev/cuda-graph"

HTTP_PORT = 8000
ADMIN_TOKEN_KEY = "token"  # data key of the admin-token Secret
# The runtime image's user (Dockerfile: useradd --uid 10001); pods run as it (restricted PSS).
RUNTIME_UID = 10001
DIST_PORT = 29500
COMPONENT_RUNTIME = "runtime"


def statefulset_name(name: str, group: int) -> str:
    """``<name>-g<group>``: the StatefulSet (and pod-name prefix) of TP group ``group``."""
    return f"{name}-g{group}"


def rank_service_name(name: str, group: int) -> str:
    """``<name>-g<group>-ranks``: the headless Service used for the rendezvous of one group."""
    return f"{name}-g{group}-ranks"


def pod_name(name: str, group: int, rank: int) -> str:
    """Pod ``rank`` of group ``group`` (StatefulSet naming: ``<sts>-<ordinal>``)."""
    return f"{statefulset_name(name, group)}-{rank}"


def admin_secret_name(name: str) -> str:
    """``<name>-admin-token``: the Secret holding the admin token of deployment ``name``."""
    return f"{name}-admin-token"


def dist_port(group: int) -> int:
    """Rendezvous port of group ``group``: ``29500 + group``.

    One port per group keeps groups apart even where pods share a host network (hostNetwork
    pods, or the local node agent that runs pods as host processes): torch's TCPStore listens
    on every address of the host.
    """
    return DIST_PORT + group


def dist_init_addr(name: str, namespace: str, group: int) -> str:
    """``host:port`` of the group's rank-0 pod through its headless Service (DESIGN 3.2)."""
    return f"{pod_name(name, group, 0)}.{rank_service_name(name, group)}.{namespace}.svc:{dist_port(group)}"


def selector_labels(name: str) -> dict[str, str]:
    """Labels selecting every pod of a deployment (immutable subset)."""
    return {LABEL_DEPLOYMENT: name}


def group_selector_labels(name: str, group: int) -> dict[str, str]:
    """Labels selecting the pods of one TP group (the StatefulSet selector, immutable)."""
    return {LABEL_DEPLOYMENT: name, LABEL_GROUP: str(group)}


def common_labels(name: str, component: str = COMPONENT_RUNTIME) -> dict[str, str]:
    """Recommended labels shared by every child object of deployment ``name``."""
    return {
        LABEL_NAME: "shardline",
        LABEL_INSTANCE: name,
        LABEL_COMPONENT: component,
        LABEL_PART_OF: "shardline",
        LABEL_MANAGED_BY: FIELD_MANAGER,
        LABEL_DEPLOYMENT: name,
    }


def group_labels(name: str, group: int, revision: str) -> dict[str, str]:
    """Labels of one group's StatefulSet and pods: common + group index + model revision."""
    return {**common_labels(name), LABEL_GROUP: str(group), LABEL_REVISION: revision}


def label_selector_string(labels: dict[str, str]) -> str:
    """``k1=v1,k2=v2`` (sorted) as the API's ``labelSelector`` query and ``status.selector`` take."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def label_value(text: str) -> str:
    """``text`` as a label value: itself when it is one (at most 63 characters of
    ``[A-Za-z0-9-_.]``, alphanumeric at both ends), else its allowed characters cut to 54 plus
    ``-`` and 8 hex digits of its sha256 (distinct texts stay distinct)."""
    if len(text) <= 63 and _LABEL_VALUE.match(text):
        return text
    kept = re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:54].strip("-_.")
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{kept}-{digest}" if kept else digest


def revision_service_name(name: str, revision: str) -> str:
    """``<name>-rev-<revision>``: the Service over the leaders serving ``revision``, a DNS
    label (lower case, at most 63 characters; a revision that does not fit is cut and given 8
    hex digits of its sha256)."""
    slug = re.sub(r"[^a-z0-9-]", "-", revision.lower()).strip("-")
    full = f"{name}-rev-{slug}"
    if slug and len(full) <= 63 and slug == revision:
        return full
    digest = hashlib.sha256(revision.encode()).hexdigest()[:8]
    return f"{name}-rev-{slug}"[: 63 - 9].rstrip("-") + f"-{digest}"
