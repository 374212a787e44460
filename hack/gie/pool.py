"""An InferencePool of runtime leaders in the local cluster with the real EPP in front.

:class:`EppFront` puts the EPP in front of the leaders of any deployment name (the operator's
fleet in ``tests/e2e/test_routing_e2e.py``); :class:`LeaderPool` makes its own leaders. Together
they install the GIE CRDs from the Go module, renders the chart with
``inferencePool.enabled`` for one deployment name, applies what the chart renders (the
InferencePool, the EPP's ConfigMap, ServiceAccount, Role, RoleBinding and Service; the EPP
Deployment only in a server-side dry run, since the node agent runs local processes, not the
EPP image), creates ``groups`` runtime leader pods labelled as the operator labels them
(``routable_leader_labels``: deployment, pod-index 0, ``shardline.dev/routable: "true"``) and
runs the EPP binary as a local process with the chart's flags and config, authenticated as the
chart's ServiceAccount (a TokenRequest token), so the chart's RBAC is what it gets.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import yaml

from hack.gie import Epp, crd_files
from shardline_operator import labels
from shardline_operator.render.services import routable_leader_labels

CHART = Path(__file__).resolve().parents[2] / "charts" / "shardline"
MODEL = "tiny-llama"


def install_crds(cluster) -> None:
    """Apply the GIE CRDs (server-side: they exceed the last-applied annotation limit)."""
    for path in crd_files():
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path), timeout=120)
    cluster.kubectl("wait", "--for", "condition=established", "--timeout=60s",
                    "crd/inferencepools.inference.networking.k8s.io",
                    "crd/inferenceobjectives.inference.networking.x-k8s.io",
                    "crd/inferencemodelrewrites.inference.networking.x-k8s.io")


def render_pool(cluster, name: str, namespace: str) -> list[dict]:
    """The chart's documents for ``inferencePool.deployments=[{name, namespace}]``."""
    out = cluster.helm("template", "shardline", str(CHART), "--namespace", "shardline-system",
                       "--set", "inferencePool.enabled=true",
                       "--set", f"inferencePool.deployments[0].name={name}",
                       "--set", f"inferencePool.deployments[0].namespace={namespace}").stdout
    return [d for d in yaml.safe_load_all(out) if d and d["metadata"].get("namespace") == namespace]


def leader_pod(name: str, namespace: str, group: int, model_path: Path, extra_args: list[str]) -> dict:
    """Group ``group``'s rank-0 pod as the pool selects it: ``shardline-runtime serve`` on
    ``model_path`` (served as :data:`MODEL`), Ready once ``/ready`` answers."""
    pod_labels = {**labels.common_labels(name), **routable_leader_labels(name),
                  labels.LABEL_GROUP: str(group)}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{labels.statefulset_name(name, group)}-0", "namespace": namespace,
                     "labels": pod_labels},
        "spec": {"restartPolicy": "Always", "terminationGracePeriodSeconds": 5, "containers": [{
            "name": "runtime", "image": "localhost/shardline-runtime:0.1.0",
            "command": ["shardline-runtime", "serve"],
            "args": ["--model-path", str(model_path), "--served-model-name", MODEL, "--host", "0.0.0.0",
                     "--port", str(labels.HTTP_PORT), "--revision", "rev-a", *extra_args],
            "ports": [{"name": "http", "containerPort": labels.HTTP_PORT}],
            "readinessProbe": {"httpGet": {"path": "/ready", "port": labels.HTTP_PORT}, "periodSeconds": 1}}]},
    }


def _service_account_kubeconfig(cluster, namespace: str, account: str, out: Path) -> Path:
    token = cluster.kubectl("create", "token", account, "-n", namespace, "--duration=2h").stdout.strip()
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    for user in config["users"]:
        user["user"] = {"token": token}
    out.write_text(yaml.safe_dump(config))
    return out


class EppFront:
    """The chart's InferencePool over the leaders of deployment ``name`` in ``namespace`` (which
    must exist: the operator's fleet or :class:`LeaderPool`'s pods), with the real EPP in front:
    CRDs installed, the chart's documents applied (the EPP Deployment only in a server-side dry
    run), the EPP run as a local process authenticated as the chart's ServiceAccount. After
    ``__enter__``: ``epp`` (:class:`hack.gie.Epp`, listening) and ``docs``."""

    def __init__(self, cluster, name: str, namespace: str, log_dir: Path) -> None:
        self.cluster, self.name, self.namespace, self.log_dir = cluster, name, namespace, log_dir
        self.docs: list[dict] = []
        self.epp: Epp | None = None

    def __enter__(self) -> EppFront:
        install_crds(self.cluster)
        self.docs = render_pool(self.cluster, self.name, self.namespace)
        applied = [d for d in self.docs if d["kind"] != "Deployment"]
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(applied))
        (deployment,) = [d for d in self.docs if d["kind"] == "Deployment"]
        self.cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(deployment))
        (config,) = [d for d in self.docs if d["kind"] == "ConfigMap"]
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        kubeconfig = _service_account_kubeconfig(self.cluster, self.namespace,
                                                 deployment["spec"]["template"]["spec"]["serviceAccountName"],
                                                 self.log_dir / f"epp-{self.namespace}.kubeconfig")
        self.epp = Epp(kubeconfig, container["args"], config["data"]["config.yaml"], self.log_dir).__enter__()
        self.epp.wait_listening()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.epp is not None:
            self.epp.__exit__(*exc)

    def pool_size(self) -> int:
        """The EPP's ``inference_pool_ready_pods`` for this pool (0 before its first sample)."""
        assert self.epp is not None
        return int(sum(self.epp.metric("inference_pool_ready_pods").values()))

    def wait_pool_size(self, n: int, timeout: float = 60) -> float:
        """Until the EPP counts ``n`` ready pods in its pool; returns the seconds waited.
        Raises RuntimeError with the EPP's log tail on timeout."""
        started = time.monotonic()
        while self.pool_size() != n:
            if time.monotonic() - started > timeout:
                assert self.epp is not None
                raise RuntimeError(f"the EPP's pool did not reach {n} pods in {timeout}s:\n{self.epp.log_tail()}")
            time.sleep(0.05)
        return time.monotonic() - started


class LeaderPool:
    """``groups`` leaders of deployment ``name`` in a new namespace, the chart's InferencePool
    over them and the EPP in front (:class:`EppFront`). After ``__enter__``: ``namespace``,
    ``endpoints`` (pod name -> ``"podIP:8000"``), ``epp`` (:class:`hack.gie.Epp`), ``docs``."""

    def __init__(self, cluster, model_path: Path, log_dir: Path, groups: int = 2, name: str = "gie",
                 extra_args: list[str] | None = None, ready_timeout: float = 300) -> None:
        self.cluster, self.model_path, self.log_dir = cluster, model_path, log_dir
        self.groups, self.name, self.extra_args = groups, name, extra_args or []
        self.ready_timeout = ready_timeout
        self.namespace = f"gie-{uuid.uuid4().hex[:6]}"
        self.client = cluster.client()
        self.endpoints: dict[str, str] = {}
        self.front = EppFront(cluster, name, self.namespace, log_dir)
        self.docs: list[dict] = []
        self.epp: Epp | None = None

    def __enter__(self) -> LeaderPool:
        self.cluster.kubectl("create", "namespace", self.namespace)
        pods = [leader_pod(self.name, self.namespace, g, self.model_path, self.extra_args)
                for g in range(self.groups)]
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(pods))
        self._wait_ready([p["metadata"]["name"] for p in pods])
        self.front.__enter__()
        self.docs, self.epp = self.front.docs, self.front.epp
        self.wait_pool_size(self.groups)
        return self

    def __exit__(self, *exc: object) -> None:
        self.front.__exit__(*exc)
        self.cluster.kubectl("delete", "namespace", self.namespace, "--wait=false", check=False)
        self.client.close()

    def _wait_ready(self, names: list[str]) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while True:
            pods = self.client.get(f"/api/v1/namespaces/{self.namespace}/pods")["items"]
            ready = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods
                     if any(c["type"] == "Ready" and c["status"] == "True"
                            for c in p.get("status", {}).get("conditions", []))}
            if set(names) <= set(ready):
                self.endpoints = {n: f"{ready[n]}:{labels.HTTP_PORT}" for n in names}
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"leaders not Ready in {self.ready_timeout}s: "
                                   f"{[(p['metadata']['name'], p.get('status')) for p in pods]}")
            time.sleep(0.5)

    def pool_size(self) -> int:
        """The EPP's ``inference_pool_ready_pods`` for this pool."""
        return self.front.pool_size()

    def wait_pool_size(self, n: int, timeout: float = 60) -> float:
        """Until the EPP counts ``n`` ready pods (:meth:`EppFront.wait_pool_size`)."""
        return self.front.wait_pool_size(n, timeout)

    def set_routable(self, pod: str, routable: bool) -> None:
        """Flip a leader's ``shardline.dev/routable`` label, as the operator's routing does."""
        self.client.merge_patch(f"/api/v1/namespaces/{self.namespace}/pods/{pod}",
                                {"metadata": {"labels": {labels.LABEL_ROUTABLE: "true" if routable else "false"}}})
