"""The runtime pod template of one TP group (pure)."""

from __future__ import annotations

import math
from typing import Any

from .. import labels
from ..runtime_args import RUNTIME_COMMAND, ServedModel, runtime_args
from ..spec import ADMIN_API_KEY_ENV, API_KEY_ENV, GPU_RESOURCE, DeploymentSpec
from .volumes import model_store_env, pod_volumes, writable_env

PROBE_PERIOD_SECONDS = 10
# Readiness is probed every second: a group is counted updated (and the next one starts) only
# once its pods are Ready again after an in-place update, so this period is the longest wait
# between the runtime serving and the rollout moving on (issue 23). ``/ready`` is a cheap GET.
READINESS_PERIOD_SECONDS = 1
# Pre-stop delay: a deleted pod leaves the Service's ready endpoints at once, but clients and
# proxies take a moment to notice; the runtime keeps serving meanwhile, then drains on SIGTERM.
PRE_STOP_SECONDS = 5
# After the drain: uvicorn's own graceful close (the drain timeout + 3 s), the schedulers'
# exit and the process teardown. The kubelet's grace period counts from the preStop hook on
# and SIGKILLs what still runs at its end, so the period is preStop + drain + this margin.
SHUTDOWN_MARGIN_SECONDS = 25


def termination_grace_seconds(spec: DeploymentSpec) -> int:
    """``terminationGracePeriodSeconds``: :data:`PRE_STOP_SECONDS` + the runtime's drain
    timeout (``--drain-timeout``, default 30 s) + :data:`SHUTDOWN_MARGIN_SECONDS`; 60 s by
    default. A fixed period would SIGKILL a runtime told to drain for longer mid-request."""
    return PRE_STOP_SECONDS + spec.runtime.drain_timeout_seconds() + SHUTDOWN_MARGIN_SECONDS


def _field_env(name: str, field_path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": field_path}}}


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def _env(spec: DeploymentSpec) -> list[dict[str, Any]]:
    """Downward-API env, the writable paths (HOME, TMPDIR, caches), the keys from Secrets
    (never in args, which ``ps`` shows), then the user's env (which may override any)."""
    keys = [
        _secret_env(ADMIN_API_KEY_ENV, labels.admin_secret_name(spec.name), labels.ADMIN_TOKEN_KEY)
    ]
    if spec.auth.api_key_secret is not None:
        keys.append(
            _secret_env(API_KEY_ENV, spec.auth.api_key_secret.name, spec.auth.api_key_secret.key)
        )
    return [
        _field_env("POD_IP", "status.podIP"),
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_INDEX", f"metadata.labels['{labels.LABEL_POD_INDEX}']"),
        *writable_env(),
        *keys,
        *model_store_env(spec),
        *[dict(item) for item in spec.runtime.env],
    ]


def _resources(spec: DeploymentSpec) -> dict[str, Any]:
    """User resources plus ``nvidia.com/gpu = gpusPerPod`` in limits and requests."""
    gpus = str(spec.parallelism.gpus_per_pod)
    resources = {section: dict(values) for section, values in spec.runtime.resources.items()}
    resources.setdefault("limits", {})[GPU_RESOURCE] = gpus
    resources.setdefault("requests", {})[GPU_RESOURCE] = gpus
    return resources


def _probe(path: str, failure_threshold: int, period: int = PROBE_PERIOD_SECONDS) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failure_threshold,
    }


def container_security_context() -> dict[str, Any]:
    """A container of the ``restricted`` Pod Security Standard with a read-only root: the
    runtime image's non-root user, no privilege escalation, every capability dropped."""
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": labels.RUNTIME_UID,
        "capabilities": {"drop": ["ALL"]},
    }


def pod_security_context() -> dict[str, Any]:
    """The pod-level half: the runtime image's user and group, ``RuntimeDefault`` seccomp."""
    return {
        "runAsNonRoot": True,
        "runAsUser": labels.RUNTIME_UID,
        "runAsGroup": labels.RUNTIME_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def build_pod_template(spec: DeploymentSpec, group: int, served: ServedModel) -> dict[str, Any]:
    """Pod template of group ``group`` serving ``served``.

    Probes (DESIGN 3.2): startup ``GET /health`` with a budget of
    ``spec.runtime.startupTimeoutSeconds`` for weight loading and graph capture; liveness
    ``GET /health``; readiness ``GET /ready`` (503 while weights load or graphs recapture).
    These stay open when API keys are set, so probes need no key.

    Deletion (restart rollouts, scale-down): a ``preStop`` sleep of :data:`PRE_STOP_SECONDS`
    while the pod leaves the endpoints, then SIGTERM, on which the runtime drops readiness and
    keeps its listener open until in-flight requests finish (``--drain-timeout``).

    Security: the pod meets the ``restricted`` Pod Security Standard (non-root user 10001 of
    the runtime image, ``RuntimeDefault`` seccomp, no privilege escalation, every capability
    dropped) and its root file system is read-only: HOME, the caches and /tmp are emptyDirs,
    /dev/shm a memory emptyDir sized for NCCL (:mod:`.volumes`); GPUs come from the device
    plugin and need none of the capabilities. A ``hostPath`` model
    volume is the user's choice and is outside ``restricted`` (and ``baseline``).
    """
    volumes, mounts = pod_volumes(spec)
    container = {
        "name": "runtime",
        "image": spec.runtime.image,
        "imagePullPolicy": spec.runtime.image_pull_policy,
        "command": list(RUNTIME_COMMAND),
        "args": runtime_args(spec, group, served),
        "env": _env(spec),
        "ports": [
            {"name": "http", "containerPort": labels.HTTP_PORT, "protocol": "TCP"},
            {"name": "dist", "containerPort": labels.dist_port(group), "protocol": "TCP"},
        ],
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "startupProbe": _probe(
            "/health", math.ceil(spec.runtime.startup_timeout_seconds / PROBE_PERIOD_SECONDS)
        ),
        "livenessProbe": _probe("/health", 6),
        "readinessProbe": _probe("/ready", 3, period=READINESS_PERIOD_SECONDS),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SECONDS}}},
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security_context(),
    }
    pod_spec: dict[str, Any] = {
        "securityContext": pod_security_context(),
        "containers": [container],
        "volumes": volumes,
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
    }
    sched = spec.scheduling
    if sched.node_selector:
        pod_spec["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in sched.tolerations]
    if sched.affinity:
        pod_spec["affinity"] = dict(sched.affinity)
    if sched.priority_class_name:
        pod_spec["priorityClassName"] = sched.priority_class_name
    return {
        "metadata": {
            # routable from the start (readiness gates the Services); ``routing.py`` takes a
            # group's leader out around an in-place update
            "labels": {
                **labels.group_labels(spec.name, group, served.revision),
                labels.LABEL_ROUTABLE: "true",
            },
            "annotations": {labels.ANNOTATION_RESTART_HASH: spec.restart_hash()},
        },
        "spec": pod_spec,
    }
