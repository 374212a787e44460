"""Shardline's main job on a fresh machine (``make demo``).

Builds or reuses the local Kubernetes 1.37.2 binaries, trains (once, then cached) a small model
that writes readable text in two revisions (hack/scenario/text_model.py), starts the control
plane and one node, installs the chart with helm (the operator runs as the chart's Deployment
pod), ``kubectl apply``s the TP=2 example pointed at revision A,
prints every status transition until Ready, asks for a chat completion, rolls the weights to
revision B in place (printing UpdatingWeights -> Ready; RecapturingGraphs shows only where the
runtime captured graphs, which CPU pods do not, and the GraphsCaptured condition says why not),
asks again, and tears everything down, also on Ctrl-C or failure.

The node (``--node``): ``real`` (the default where it can run: root, Linux, the Debian packages
of ``hack/install_node_deps.sh``, which it installs) is a real kubelet with containerd and runc,
the CNI bridge, kube-proxy and CoreDNS; both images are built by ``hack.images`` (cached by
input hash) and every pod runs as a container. Chats go through the client Service's ClusterIP
from the node's network namespace. ``agent`` is the fallback for machines that cannot run a
node (not root): fake GPU nodes whose pods the node agent runs as local processes, with chats
sent to the leader's pod IP. See docs/local-cluster.md.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
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
from hack.scenario.node_client import chat_in_node  # noqa: E402
from hack.scenario.operator_install import install_operator, operator_logs  # noqa: E402
from hack.scenario.serving import chat, leader_ip  # noqa: E402
from hack.scenario.status_watch import Snapshot, StatusWatcher  # noqa: E402
from hack.scenario.text_model import PROMPT  # noqa: E402

NAMESPACE = "shardline-demo"
READY_TIMEOUT = 600
MAX_TOKENS = 32
NODE_TOOLS = ("containerd", "runc", "buildah", "mmdebstrap", "iptables")
# The example asks 1 CPU and 2 GiB per pod, sized for a GPU node; the real node has this
# machine's CPUs for the operator and both ranks, so the demo's requests shrink (no limits).
REAL_NODE_REQUESTS = {"cpu": "100m", "memory": "256Mi"}
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
    if cluster.real_node:
        step("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler (v1.37.2) "
             "and a real node: containerd + runc, CNI bridge, kubelet, kube-proxy, CoreDNS "
             "(importing the images into the node's containerd takes minutes)")
    else:
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
    if cluster.real_node:
        doc["spec"].setdefault("runtime", {}).setdefault("resources", {})["requests"] = dict(
            REAL_NODE_REQUESTS)
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
    if cluster.real_node:
        print(cluster.node.crictl("ps").rstrip())
        service = client.get(f"/api/v1/namespaces/{ns}/services/{name}")
        ip, via = service["spec"]["clusterIP"], "the client Service's ClusterIP"

        def ask() -> str:
            return chat_in_node(cluster, ip, model, PROMPT, max_tokens=MAX_TOKENS)
    else:
        ip, via = leader_ip(client, ns, name), "the group leader's pod IP"

        def ask() -> str:
            return chat(ip, model, PROMPT, max_tokens=MAX_TOKENS)

    step(f"chat completion through {via} http://{ip}:8000/v1 (rev-a)")
    before = ask()
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
    after = ask()
    print(f"    user: {PROMPT}\n    {model}: {after!r}")
    print(f"    the answer {'changed' if after != before else 'did NOT change'} with the weights")
    watch.stop()
    if keep:
        step(f"leaving the cluster running: export KUBECONFIG={cluster.kubeconfig}; "
             f"stop it with: python3 -m hack.localcluster down --dir {cluster.state_dir}")
        return
    step(f"kubectl delete infd {name}")
    cluster.kubectl("delete", "infd", name, "-n", ns, "--timeout=120s", timeout=180)


def _real_node_wanted(choice: str) -> bool:
    """Whether to run the real node; installs its Debian packages when it will. Raises
    SystemExit when ``--node real`` was asked for on a machine that cannot run it."""
    if choice == "agent":
        return False
    why = None
    if sys.platform != "linux":
        why = "the real node needs Linux"
    elif os.geteuid() != 0:
        why = "the real node needs root (network namespaces, mounts, cgroups)"
    if why:
        if choice == "real":
            raise SystemExit(f"--node real: {why}")
        step(f"node: the node agent ({why}; see docs/local-cluster.md)")
        return False
    if any(shutil.which(t) is None for t in NODE_TOOLS):
        step("node: installing containerd, runc, buildah, mmdebstrap, iptables and the CNI "
             "plugins (hack/install_node_deps.sh)")
        subprocess.run(["bash", str(REPO_ROOT / "hack" / "install_node_deps.sh")], check=True)
    return True


def _images() -> dict[str, Path]:
    """Both images (``hack.images``: cached by a hash of their inputs), by image name."""
    from hack.images.build import ensure_images, image_name

    step("container images: localhost/shardline-operator and localhost/shardline-runtime "
         "(buildah on an mmdebstrap base; about 50 min cold on a busy 2-core machine, minutes "
         "after a source change, instant when unchanged)")
    return {image_name(t): archive for t, archive in ensure_images().items()}


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--state-dir", type=Path, default=None,
                   help="cluster state directory (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true",
                   help="leave the cluster and the deployment running at the end")
    p.add_argument("--node", choices=("auto", "real", "agent"), default="auto",
                   help="real: a kubelet running containers; agent: local processes; auto "
                        "(default): real where this machine can run it (root on Linux)")
    args = p.parse_args(argv)
    real = _real_node_wanted(args.node)
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="shardline-demo-"))
    signal.signal(signal.SIGTERM, _interrupt)
    step("local Kubernetes binaries (built into ~/.cache/shardline on first use: 10-20 min "
         "on 2 cores for the control plane, about as long again for the node's; reused "
         "afterwards)")
    build.ensure_binaries(names=build.ALL_BINARIES + (build.NODE_BINARIES if real else ()))
    images = _images() if real else {}
    cluster = LocalCluster(state_dir=state_dir, real_node=real, images=images)
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
            step("tearing down: stopping the node and the control plane")
            cluster.stop()
            if ok and args.state_dir is None:
                shutil.rmtree(state_dir, ignore_errors=True)
    if ok:
        step("done")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
