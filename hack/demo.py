"""Shardline's main job on a fresh machine (``make demo``).

Builds or reuses the local Kubernetes 1.37.2 binaries, trains (once, then cached) a small model
that writes readable text in two revisions (hack/scenario/text_model.py), starts the control
plane with fake GPU nodes and the node agent, installs the chart with helm (the operator runs
as the chart's Deployment pod), ``kubectl apply``s the TP=2 example pointed at revision A,
prints every status transition until Ready, asks for a chat completion, rolls the weights to
revision B in place (printing UpdatingWeights -> Ready; RecapturingGraphs shows only where the
runtime captured graphs, which CPU pods do not, and the GraphsCaptured condition says why not),
asks again, and tears everything down, also on Ctrl-C or failure.
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from hack.localcluster import LocalCluster, build  # noqa: E402
from hack.scenario.examples import tp2_example  # noqa: E402
from hack.scenario.models import write_text_revisions  # noqa: E402
from hack.scenario.operator_install import install_operator, operator_logs  # noqa: E402
from hack.scenario.serving import chat, leader_ip  # noqa: E402
from hack.scenario.status_watch import Snapshot, StatusWatcher  # noqa: E402
from hack.scenario.text_model import PROMPT  # noqa: E402

NAMESPACE = "shardline-demo"
READY_TIMEOUT = 600
MAX_TOKENS = 32
STARTED = time.monotonic()


def step(msg: str) -> None:
    print(f"\n==> [{time.monotonic() - STARTED:6.1f} s] {msg}", flush=True)


def show_transition(snap: Snapshot) -> None:
    if snap.phase:  # the first version of a new object has no status yet
        print(f"    status: {snap.line()}", flush=True)


def run(cluster: LocalCluster, keep: bool) -> None:
    step("model revisions under /var/lib/shardline/models/text-llama/ (trained on the King James "
         "Bible on first use: a few minutes of CPU; cached in ~/.cache/shardline afterwards)")
    revisions = write_text_revisions(log=lambda line: print(line, flush=True))
    for name, path in revisions.items():
        print(f"    {name}: {path}")
    step("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler (v1.37.2), "
         "fake GPU nodes and the node agent")
    cluster.start()
    print(cluster.kubectl("version").stdout.rstrip())
    print(cluster.kubectl("get", "nodes", "-o", "custom-columns=NODE:.metadata.name,"
                          "GPUS:.status.capacity.nvidia\\.com/gpu").stdout.rstrip())
    step("helm install charts/shardline (the operator runs as the chart's Deployment pod)")
    install_operator(cluster)
    print(cluster.kubectl("get", "deploy,pods", "-n", "shardline-system").stdout.rstrip())

    path, doc = tp2_example()
    doc["spec"]["model"].update(name="kjv-llama", path=str(revisions["rev-a"]), revision="rev-a")
    name, model = doc["metadata"]["name"], doc["spec"]["model"]["name"]
    ns = doc["metadata"].get("namespace") or NAMESPACE
    cluster.kubectl("create", "namespace", ns, check=False)
    client = cluster.client()
    watch = StatusWatcher(client, ns, name, on_change=show_transition).start()
    step(f"kubectl apply -f {path.relative_to(REPO_ROOT)} -n {ns} (spec.model: {model}, rev-a)")
    print(cluster.kubectl("apply", "-f", "-", "-n", ns, input=yaml.safe_dump(doc)).stdout.rstrip())
    watch.wait(lambda s: s.phase == "Ready" and s.ready_replicas >= 1, READY_TIMEOUT,
               "phase Ready")
    print(cluster.kubectl("get", "infd", "-n", ns).stdout.rstrip())
    print(cluster.kubectl("get", "pods", "-n", ns, "-o", "wide").stdout.rstrip())

    ip = leader_ip(client, ns, name)
    step(f"chat completion through the group leader http://{ip}:8000/v1 (rev-a)")
    before = chat(ip, model, PROMPT, max_tokens=MAX_TOKENS)
    print(f"    user: {PROMPT}\n    {model}: {before!r}")

    step("rolling the weights in place to rev-b (kubectl patch spec.model)")
    mark = watch.mark()
    patch = {"spec": {"model": {"path": str(revisions["rev-b"]), "revision": "rev-b"}}}
    cluster.kubectl("patch", "infd", name, "-n", ns, "--type", "merge", "-p", json.dumps(patch))
    watch.wait(lambda s: s.phase == "Ready" and s.served_revision == "rev-b"
               and s.observed_generation == s.generation, READY_TIMEOUT, "Ready on rev-b", mark)
    print(f"    phases: {' -> '.join(watch.phases_since(mark))}")
    graphs = '{.status.conditions[?(@.type=="GraphsCaptured")]}'
    condition = json.loads(cluster.kubectl("get", "infd", name, "-n", ns, "-o", f"jsonpath={graphs}").stdout)
    print(f"    GraphsCaptured={condition['status']} ({condition['reason']}): {condition['message']}")
    print(cluster.kubectl("get", "infd", "-n", ns).stdout.rstrip())
    step("chat completion after the rollout (rev-b, same pods)")
    after = chat(ip, model, PROMPT, max_tokens=MAX_TOKENS)
    print(f"    user: {PROMPT}\n    {model}: {after!r}")
    print(f"    the answer {'changed' if after != before else 'did NOT change'} with the weights")
    watch.stop()
    if keep:
        step(f"leaving the cluster running: export KUBECONFIG={cluster.kubeconfig}; "
             f"stop it with: python3 -m hack.localcluster down --dir {cluster.state_dir}")
        return
    step(f"kubectl delete infd {name}")
    cluster.kubectl("delete", "infd", name, "-n", ns, "--timeout=120s", timeout=180)


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-dir", type=Path, default=None,
                   help="cluster state directory (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true",
                   help="leave the cluster and the deployment running at the end")
    args = p.parse_args(argv)
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="shardline-demo-"))
    signal.signal(signal.SIGTERM, _interrupt)
    step("local Kubernetes binaries (built into ~/.cache/shardline on first use: 10-20 min "
         "on 2 cores; reused afterwards)")
    build.ensure_binaries()
    cluster = LocalCluster(state_dir=state_dir)
    ok = False
    try:
        run(cluster, args.keep)
        ok = True
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    except Exception as e:  # report, then tear down
        print(f"\nFAILED: {e}", file=sys.stderr)
        if cluster.pids:
            print(operator_logs(cluster), file=sys.stderr)
            print(f"(cluster logs in {cluster.log_dir}, pod logs in {state_dir / 'pods'})",
                  file=sys.stderr)
    finally:
        if not (ok and args.keep):
            # A second Ctrl-C must not abandon half-stopped processes.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            step("tearing down: stopping the node agent and control plane by PID")
            cluster.stop()
            if ok and args.state_dir is None:
                shutil.rmtree(state_dir, ignore_errors=True)
    if ok:
        step("done")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
