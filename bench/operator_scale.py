"""What the operator costs as objects grow: 50 InferenceDeployments in the local cluster.

For each replica count (0 and 1) the script, in a fresh namespace of one local cluster:

1. starts the operator from ``--operator-path`` (a directory holding ``shardline_operator``;
   default: this checkout) as a local process watching that namespace;
2. ``kubectl apply``s 50 InferenceDeployments at once and times until every child exists
   (client Service and PDB; at 1 replica also the StatefulSet, the rank Service and the pod)
   and until every object's status is settled (Ready at 1 replica, with ``FakeKubelet`` playing
   kubelet for the pods; ``observedGeneration`` set at 0);
3. with the objects idle, counts the API server's requests (``apiserver_request_total``,
   every resource verb but WATCH, read from its ``/metrics``) over ``--window`` seconds with
   the operator running, then over the same window with the operator stopped; the difference,
   per object and per minute, is what the operator spends on an idle object.

Usage (builds the cluster binaries on first use)::

    python bench/operator_scale.py [--objects 50] [--window 60] [--operator-path DIR] [--label NAME]

To measure another version of the operator, export its tree and point ``--operator-path`` at
its ``operator/`` directory, e.g. ``git archive <commit> operator | tar -x -C /tmp/before``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "operator")]

from fake_kubelet import NODE, TOLERATION, FakeKubelet, ensure_node  # noqa: E402

from hack.localcluster import LocalCluster  # noqa: E402


def deployment(name: str, namespace: str, replicas: int) -> dict:
    return {"apiVersion": "shardline.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": replicas,
                     "model": {"name": "tiny", "path": "/var/lib/shardline/models/tiny-llama/rev-a",
                               "revision": "rev-a", "volume": {"hostPath": {"path": "/var/lib/shardline/models"}}},
                     "parallelism": {"tensor": 1, "gpusPerPod": 1},
                     "runtime": {"image": "ghcr.io/shardline/shardline-runtime:0.1.0"},
                     "scheduling": {"nodeSelector": {"kubernetes.io/hostname": NODE}, "tolerations": [TOLERATION]}}}


def api_requests(client) -> dict[tuple[str, str], float]:
    """``{(verb, resource): count}`` of finished requests so far (WATCH and non-resource excluded)."""
    text = client._client.get("/metrics").text  # noqa: SLF001 (raw text, not JSON)
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "apiserver_request":
            continue
        for s in family.samples:
            if s.name.endswith("_total") and s.labels.get("resource") and s.labels.get("verb") not in ("WATCH",):
                key = (s.labels["verb"], s.labels["resource"] + (f"/{s.labels['subresource']}"
                                                                   if s.labels.get("subresource") else ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


def count_over(client, seconds: float) -> dict[tuple[str, str], float]:
    before = api_requests(client)
    time.sleep(seconds)
    after = api_requests(client)
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 0}


def wait(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)
    return time.monotonic() - start


def children_done(client, namespace: str, objects: int, replicas: int) -> bool:
    def count(path: str) -> int:
        return len(client.get(path.format(ns=namespace))["items"])
    services = count("/api/v1/namespaces/{ns}/services")
    pdbs = count("/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets")
    if replicas == 0:
        return services == objects and pdbs == objects
    sts = count("/apis/apps/v1/namespaces/{ns}/statefulsets")
    pods = count("/api/v1/namespaces/{ns}/pods")
    return services == 2 * objects and pdbs == objects and sts == objects and pods == objects


def settled(client, namespace: str, objects: int, replicas: int) -> bool:
    items = client.get(f"/apis/shardline.dev/v1alpha1/namespaces/{namespace}/inferencedeployments")["items"]
    if replicas == 0:
        return sum(1 for i in items if (i.get("status") or {}).get("observedGeneration")) == objects
    return sum(1 for i in items if (i.get("status") or {}).get("phase") == "Ready") == objects


def start_operator(cluster, operator_path: Path, namespace: str, log: Path) -> subprocess.Popen:
    env = dict(cluster.env, PYTHONPATH=str(operator_path), SHARDLINE_METRICS_PORT="0")
    return subprocess.Popen([sys.executable, "-m", "shardline_operator.cli", "--namespace", namespace,
                             "--liveness-endpoint", "http://127.0.0.1:0/healthz"],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def run(cluster, operator_path: Path, replicas: int, objects: int, window: float, label: str) -> dict:
    client = cluster.client()
    namespace = f"scale-{label}-r{replicas}"
    cluster.kubectl("create", "namespace", namespace)
    kubelet = FakeKubelet(client, namespace).start() if replicas else None
    log = cluster.state_dir / f"operator-{namespace}.log"
    operator = start_operator(cluster, operator_path, namespace, log)
    time.sleep(5)  # the operator's watches are up before the objects arrive
    docs = yaml.safe_dump_all([deployment(f"m{i:02d}", namespace, replicas) for i in range(objects)])
    start = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=docs)
    applied = time.monotonic() - start
    children = wait(lambda: children_done(client, namespace, objects, replicas), 600, "children") + applied
    settle = wait(lambda: settled(client, namespace, objects, replicas), 600, "status settled") + children
    if kubelet is not None:
        kubelet.stop()  # pods stay Ready; the kubelet's own polling must not be counted
    time.sleep(10)
    with_operator = count_over(client, window)
    operator.terminate()
    operator.wait(30)
    time.sleep(3)
    without = count_over(client, window)
    keys = set(with_operator) | set(without)
    delta = {k: with_operator.get(k, 0.0) - without.get(k, 0.0) for k in keys}
    per_object_minute = sum(delta.values()) / objects / (window / 60)
    client.close()
    return {"label": label, "replicas": replicas, "objects": objects, "apply_s": applied,
            "children_s": children, "settled_s": settle, "per_object_per_minute": per_object_minute,
            "with": sum(with_operator.values()), "without": sum(without.values()),
            "top": sorted(((v, k) for k, v in delta.items() if v > 0), reverse=True)[:6]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objects", type=int, default=50)
    p.add_argument("--window", type=float, default=60.0, help="seconds of each request count")
    p.add_argument("--replicas", type=int, nargs="+", default=[0, 1])
    p.add_argument("--operator-path", type=Path, default=ROOT / "operator",
                   help="directory containing the shardline_operator package to measure")
    p.add_argument("--label", default="this", help="name of the measured operator in the output")
    args = p.parse_args(argv)
    cluster = LocalCluster(state_dir=Path(tempfile.mkdtemp(prefix="shardline-scale-")))
    results = []
    try:
        cluster.start(with_agent=False)
        cluster.kubectl("apply", "-f", str(ROOT / "crds" / "inferencedeployment.yaml"))
        cluster.kubectl("wait", "--for", "condition=established", "--timeout=60s",
                        "crd/inferencedeployments.shardline.dev")
        ensure_node(cluster.client(), gpus=1000)
        for replicas in args.replicas:
            r = run(cluster, args.operator_path.resolve(), replicas, args.objects, args.window, args.label)
            results.append(r)
            print(f"{r['label']}: replicas={replicas} objects={r['objects']}: children created in "
                  f"{r['children_s']:.1f} s, status settled in {r['settled_s']:.1f} s (kubectl apply "
                  f"{r['apply_s']:.1f} s); idle API requests/min/object {r['per_object_per_minute']:.2f} "
                  f"({r['with']:.0f} with the operator vs {r['without']:.0f} without in {args.window:.0f} s); "
                  f"top: {r['top']}", flush=True)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
