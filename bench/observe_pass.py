"""How long a reconcile pass's read step (``observe``) takes, against a real API server.

Starts the local control plane (``hack/localcluster``), creates the children of one
InferenceDeployment of ``--groups`` groups by hand (a StatefulSet and two pods per group, the
client Service, a NetworkPolicy; the pods tolerate every taint and are marked Running with an
IP, so their leaders are asked), and times ``observe`` with a leader client whose
``/get_server_info`` takes ``--leader-ms`` (a busy leader's answer), the median over
``--rounds`` calls. With ``--baseline-tree DIR`` it also loads ``observe.py`` from another
checkout (its ``operator/shardline_operator/observe.py``, resolved against this checkout's
package) and alternates the two in one process, printing the median of the paired ratios.

Usage::

    python bench/observe_pass.py [--groups 3] [--leader-ms 0 30] [--rounds 40] [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "operator"), str(ROOT / "tests" / "operator")]

from hack.localcluster import LocalCluster  # noqa: E402

NAME, NS = "bench", "default"


def load_baseline(tree: Path):
    """``observe.py`` of another checkout, as a module of this checkout's package."""
    spec = importlib.util.spec_from_file_location(
        "shardline_operator._baseline_observe", tree / "operator" / "shardline_operator" / "observe.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def create_children(kube, labels, groups: int) -> None:
    lab = dict(labels.selector_labels(NAME))
    for g in range(groups):
        glab = dict(lab, **{labels.LABEL_GROUP: str(g)})
        kube.create({"apiVersion": "apps/v1", "kind": "StatefulSet",
                     "metadata": {"name": f"{NAME}-g{g}", "namespace": NS, "labels": glab},
                     # a selector the pods below lack: the StatefulSet controller must not adopt them
                     "spec": {"replicas": 0, "serviceName": f"{NAME}-g{g}", "selector": {"matchLabels": {"only": f"g{g}"}},
                              "template": {"metadata": {"labels": {"only": f"g{g}"}},
                                           "spec": {"containers": [{"name": "c", "image": "x"}]}}}})
        for rank in range(2):
            pod = f"{NAME}-g{g}-{rank}"
            kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "namespace": NS, "labels": glab},
                         "spec": {"containers": [{"name": "c", "image": "x"}], "tolerations": [{"operator": "Exists"}]}})
            kube.merge_patch("v1", "Pod", NS, pod, {"status": {"phase": "Running", "podIP": f"10.0.{g}.{rank + 1}"}},
                             subresource="status")
    kube.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": NAME, "namespace": NS, "labels": lab},
                 "spec": {"ports": [{"port": 80}]}})
    kube.create({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                 "metadata": {"name": NAME, "namespace": NS, "labels": lab}, "spec": {"podSelector": {}}})


class SlowLeaders:
    """A leader client whose ``/get_server_info`` answers nothing after ``seconds``."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.calls = 0

    def server_info(self, url):
        self.calls += 1
        time.sleep(self.seconds)
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--leader-ms", type=float, nargs="+", default=[0.0, 30.0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--baseline-tree", type=Path, default=None)
    args = p.parse_args(argv)
    cluster = LocalCluster(state_dir=Path(tempfile.mkdtemp(prefix="shardline-observe-")))
    cluster.start(with_agent=False)
    try:
        os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
        from conftest import BASE_SPEC
        from shardline_operator import labels, observe
        from shardline_operator.kube import KubeClient
        from shardline_operator.spec import parse_spec

        kube = KubeClient()
        create_children(kube, labels, args.groups)
        spec = parse_spec(NAME, NS, "uid", dict(BASE_SPEC, replicas=args.groups))
        sides = {"this tree": observe}
        if args.baseline_tree:
            sides["baseline"] = load_baseline(args.baseline_tree)
        for leader_ms in args.leader_ms:
            times: dict[str, list[float]] = {side: [] for side in sides}
            for r in range(args.rounds + 1):  # round 0 warms up
                for side in (list(sides) if r % 2 else list(reversed(sides))):
                    leaders = SlowLeaders(leader_ms / 1e3)
                    start = time.perf_counter()
                    seen = sides[side].observe(kube, leaders, spec, 1, {})
                    elapsed = time.perf_counter() - start
                    assert len(seen.groups) == args.groups and leaders.calls == args.groups, (
                        f"children not seen: {leaders.calls} leaders asked; {seen.groups}")
                    if r:
                        times[side].append(elapsed)
            line = ", ".join(f"{side} {statistics.median(t) * 1e3:.1f} ms" for side, t in times.items())
            if args.baseline_tree:
                pairs = [a / b for a, b in zip(times["this tree"], times["baseline"])]
                line += f"; this tree / baseline, median of paired ratios {statistics.median(pairs):.2f}"
            print(f"observe, {args.groups} groups, leaders answer in {leader_ms:g} ms: median {line}", flush=True)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
