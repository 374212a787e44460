"""Install and remove the Shardline chart with the real helm CLI. On the real node the kubelet
runs the operator's Deployment pod from the operator image; with the node agent it runs as a
local process with its ServiceAccount token mounted where kubelet mounts it. Either way the
operator takes its in-cluster branch, so the chart's RBAC is what it really gets."""
from __future__ import annotations

from pathlib import Path

from hack.localcluster import LocalCluster

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "shardline"
RELEASE = "shardline"
OPERATOR_NAMESPACE = "shardline-system"


def install_operator(cluster: LocalCluster, namespace: str = OPERATOR_NAMESPACE,
                     release: str = RELEASE, timeout: str = "5m", values: dict | None = None) -> str:
    """``helm upgrade --install`` the chart (``values``: chart values to ``--set``, e.g.
    ``{"logLevel": "debug"}``) and wait for the operator Deployment to be Ready; returns helm's
    output. Raises RuntimeError (with helm's output) on failure."""
    sets = [arg for key, value in (values or {}).items() for arg in ("--set", f"{key}={value}")]
    try:
        proc = cluster.helm("upgrade", "--install", release, str(CHART), "--namespace",
                            namespace, "--create-namespace", "--wait", "--timeout", timeout,
                            *sets, timeout=600)
    except RuntimeError as e:
        pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "yaml", check=False)
        raise RuntimeError(f"{e}\npods in {namespace}:\n{pods.stdout}\n"
                           f"{operator_logs(cluster, namespace)}") from None
    return proc.stdout


def uninstall_operator(cluster: LocalCluster, namespace: str = OPERATOR_NAMESPACE,
                       release: str = RELEASE) -> None:
    cluster.helm("uninstall", release, "--namespace", namespace, "--wait", check=False)


def operator_logs(cluster: LocalCluster, namespace: str = OPERATOR_NAMESPACE) -> str:
    """Logs of the operator pod (for failure reports): ``kubectl logs`` on a real node, the
    files the node agent recorded otherwise."""
    if cluster.real_node:
        proc = cluster.kubectl("logs", "-n", namespace, "deployment/shardline", "--tail=80",
                               check=False)
        return f"== operator logs\n{proc.stdout}{proc.stderr}"
    pods_dir = cluster.state_dir / "pods"
    out = []
    for log in sorted(pods_dir.glob(f"{namespace}_*/*.log")):
        out.append(f"== {log}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-60:]))
    return "\n".join(out)
