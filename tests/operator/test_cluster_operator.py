"""The operator against a real kube-apiserver (local cluster, marker ``cluster``).

The operator runs as the Helm chart's Deployment pod (run by the node agent under the chart's
ServiceAccount and RBAC). The InferenceDeployments here pin their pods to a node without a
node agent; ``FakeKubelet`` plays kubelet for it, so each test decides whether pods get Ready
or crash, while the scheduler, StatefulSet, EndpointSlice and garbage-collector controllers
are the real ones. Field cases K1, K2, K4, K5.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fake_kubelet import NODE, TOLERATION, FakeKubelet, ensure_node

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAMESPACE = "operator-it"
ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


class Operator:
    def __init__(self, cluster):
        self.cluster, self.client = cluster, cluster.client()

    def kubectl(self, *args, **kw):
        return self.cluster.kubectl(*args, "-n", NAMESPACE, **kw)

    def apply(self, doc, check=True, dry_run=False):
        extra = ["--dry-run=server", "-o", "json"] if dry_run else []
        return self.kubectl("apply", *extra, "-f", "-", input=yaml.safe_dump(doc), check=check)

    def get(self, name):
        return self.client.get(f"/apis/shardline.dev/v1alpha1/namespaces/{NAMESPACE}/inferencedeployments/{name}",
                               ok_missing=True)

    def status(self, name):
        return (self.get(name) or {}).get("status") or {}

    def pods(self, name):
        items = self.client.get(f"/api/v1/namespaces/{NAMESPACE}/pods",
                                params={"labelSelector": f"shardline.dev/deployment={name}"})["items"]
        return {p["metadata"]["name"]: p for p in items}

    def wait_phase(self, name, phase, timeout=90):
        return wait_for(lambda: self.status(name).get("phase") == phase and self.status(name), timeout,
                        f"{name} phase {phase}")


def deployment(name, **spec):
    body = {
        "replicas": 1,
        "model": {"name": "tiny-llama", "path": "/var/lib/shardline/models/tiny-llama/rev-a", "revision": "rev-a",
                  "volume": {"hostPath": {"path": "/var/lib/shardline/models", "type": "DirectoryOrCreate"}}},
        "parallelism": {"tensor": 2, "gpusPerPod": 1},
        "runtime": {"image": "ghcr.io/shardline/shardline-runtime:0.1.0"},
        "scheduling": {"nodeSelector": {"kubernetes.io/hostname": NODE}, "tolerations": [TOLERATION]},
        "restartPolicy": {"maxGroupRestarts": 3, "backoffSeconds": 1},
    }
    body.update(spec)
    return {"apiVersion": "shardline.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": body}


@pytest.fixture(scope="module")
def op(kube_cluster, tmp_path_factory):
    """The operator, by default installed with the chart (``install_operator``); with
    ``SHARDLINE_TEST_OPERATOR=local`` run from the working tree as a process of this test
    (no helm or node agent needed; the chart's RBAC is then not exercised)."""
    from hack.scenario.operator_install import install_operator, operator_logs

    process = None
    if os.environ.get("SHARDLINE_TEST_OPERATOR") == "local":
        kube_cluster.kubectl("apply", "-f", str(ROOT / "crds" / "inferencedeployment.yaml"))
        kube_cluster.kubectl("wait", "--for", "condition=established", "--timeout=60s",
                             "crd/inferencedeployments.shardline.dev")
        log = tmp_path_factory.mktemp("operator") / "operator.log"
        env = dict(kube_cluster.env, PYTHONPATH=str(ROOT / "operator"))
        process = subprocess.Popen(
            [sys.executable, "-m", "shardline_operator.cli", "--namespace", NAMESPACE,
             "--liveness-endpoint", "http://127.0.0.1:0/healthz", "--metrics-port", "0"],
            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        logs = log.read_text
    else:
        install_operator(kube_cluster)
        logs = lambda: operator_logs(kube_cluster)  # noqa: E731
    operator = Operator(kube_cluster)
    ensure_node(operator.client)
    kube_cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    operator.kubelet = FakeKubelet(operator.client, NAMESPACE).start()
    operator.logs = logs
    yield operator
    kube_cluster.kubectl("delete", "infd", "--all", "-n", NAMESPACE, "--timeout=60s", check=False, timeout=90)
    # Keep playing kubelet until the garbage collector's pod deletions are finished.
    try:
        wait_for(lambda: not operator.client.get(f"/api/v1/namespaces/{NAMESPACE}/pods")["items"], 60, "pods gone")
    finally:
        operator.kubelet.stop()
    if process is not None:
        process.terminate()
        process.wait(timeout=30)


def test_operator_pod_uses_the_in_cluster_service_account(op, kube_cluster):
    """The chart's operator pod runs with no KUBECONFIG and the ServiceAccount token mounted at
    the standard path, so the operator takes its in-cluster branch (``kube.load_configuration``
    and Kopf's login); every other test of this module then exercises it."""
    from hack.node_agent import service_account

    if os.environ.get("SHARDLINE_TEST_OPERATOR") == "local":
        pytest.skip("the operator runs as a local process of this test, with the test's KUBECONFIG")
    if not service_account.mount_namespaces_work()[0]:
        pytest.skip("no mount namespaces here: the node agent gives pods a KUBECONFIG instead")
    pids = sorted((kube_cluster.state_dir / "pods").glob("shardline-system_*/*.pid"), key=lambda p: p.stat().st_mtime)
    assert pids, "no operator pod process"
    pid = int(pids[-1].read_text())
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    env = dict(item.split("=", 1) for item in environ if "=" in item)
    assert "KUBECONFIG" not in env, env.get("KUBECONFIG")
    assert env["KUBERNETES_SERVICE_HOST"] and env["KUBERNETES_SERVICE_PORT"]
    # the token as the operator's mount namespace shows it (/var/run is a link to /run)
    token_file = Path(f"/proc/{pid}/root") / os.path.realpath(service_account.MOUNT_PATH / "token").lstrip("/")
    claims = json.loads(base64.urlsafe_b64decode(token_file.read_text().split(".")[1] + "=="))
    assert claims["sub"].startswith("system:serviceaccount:shardline-system:"), claims["sub"]
    assert not (service_account.MOUNT_PATH / "token").exists()  # nobody else sees it
    op.apply(deployment("incluster"))  # with that identity the operator renders and writes status
    wait_for(lambda: op.status("incluster").get("phase"), 90, "status written by the operator")
    assert op.client.get(f"/apis/apps/v1/namespaces/{NAMESPACE}/statefulsets/incluster-g0", ok_missing=True)
    op.kubectl("delete", "infd", "incluster", "--timeout=60s")


@pytest.mark.parametrize("change, message", [
    ({"parallelism": {"tensor": 3, "gpusPerPod": 2}}, "must be a multiple of spec.parallelism.gpusPerPod"),
    ({"replicas": -1}, "spec.replicas"),
    ({"runtime": {"image": "r:1", "dtype": "int4"}}, "spec.runtime.dtype"),
    ({"runtime": {"image": "r:1", "args": ["--tp-size=4"]}}, "must not set a flag the operator renders"),
    ({"runtime": {"image": "r:1", "env": [{"name": "POD_IP", "value": "1.2.3.4"}]}}, "must not set POD_IP"),
    ({"runtime": {"image": "r:1", "resources": {"limits": {"nvidia.com/gpu": 2}}}}, "must not set nvidia.com/gpu"),
    ({"runtime": {"image": "r:1", "memFractionStatic": 0}}, "spec.runtime.memFractionStatic"),
    ({"runtime": {}}, "spec.runtime.image"),
    ({"model": {"name": "m", "path": "relative"}}, "spec.model.path"),
    ({"model": {"name": "m", "path": "/elsewhere/m", "volume": {"hostPath": {"path": "/x"}}}},
     "must be inside spec.model.mountPath"),
    ({"model": {"name": "m"}}, "set exactly one of spec.model.path and spec.model.uri"),
    ({"model": {"name": "m", "uri": "hf://only-one"}}, "spec.model.uri must be hf://ORG/NAME"),
    ({"model": {"name": "m", "uri": "hf://a/b", "s3": {"region": "x"}}}, "spec.model.s3 applies to"),
    ({"model": {"name": "m", "uri": "pvc://c/p", "credentialsSecretRef": {"name": "k"}}},
     "apply to an hf:// or s3:// spec.model.uri only"),
    ({"weightUpdate": {"strategy": "Rolling"}}, "spec.weightUpdate.strategy"),
    ({"weightUpdate": {"maxUnavailable": 0}}, "spec.weightUpdate.maxUnavailable"),
    ({"weightUpdate": {"canary": {"verify": {"prompt": "   "}}}}, "prompt must not be blank"),
    ({"weightUpdate": {"canary": {"verify": {"prompt": "hi", "maxLatencySeconds": 0}}}},
     "spec.weightUpdate.canary.verify.maxLatencySeconds"),
    ({"weightUpdate": {"strategy": "Restart", "canary": {}}}, "canary applies to strategy InPlace only"),
])
def test_api_server_rejects_invalid_specs(op, change, message):
    proc = op.apply(deployment("invalid", **change), check=False, dry_run=True)
    assert proc.returncode != 0, proc.stdout
    assert message in proc.stderr, proc.stderr


def test_api_server_rejects_long_names_and_applies_defaults(op):
    proc = op.apply(deployment("n" * 41), check=False, dry_run=True)
    assert proc.returncode != 0 and "at most 40 characters" in proc.stderr
    accepted = json.loads(op.apply(deployment("defaults"), dry_run=True).stdout)["spec"]
    assert accepted["weightUpdate"] == {"strategy": "InPlace", "timeoutSeconds": 900, "rollbackOnFailure": True,
                                        "maxUnavailable": 1, "pauseSeconds": 0}
    assert accepted["runtime"]["cudaGraph"] == {"enabled": True, "maxBatchSize": 160}
    assert accepted["service"] == {"type": "ClusterIP", "port": 8000}


def test_children_status_columns_endpoints_and_delete(op):
    """A valid CR gets its children (owned), status (K5), printer columns; K1; deletion cascades."""
    op.kubelet.ready = lambda pod: False
    op.apply(deployment("basic"))
    uid = op.get("basic")["metadata"]["uid"]
    children = [("statefulsets", "basic-g0"), ("services", "basic-g0-ranks"), ("services", "basic"),
                ("poddisruptionbudgets", "basic")]
    for kind, name in children:
        obj = json.loads(wait_for(lambda: op.kubectl("get", kind, name, "-o", "json", check=False).stdout, 60,
                                  f"{kind}/{name}"))
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
    # K1: the rank Service publishes both ranks (with DNS hostnames) before any is Ready.
    def rank_endpoints():
        slices = op.client.get(f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices",
                               params={"labelSelector": "kubernetes.io/service-name=basic-g0-ranks"})["items"]
        return sorted(e.get("hostname") for s in slices for e in s.get("endpoints") or [])
    assert wait_for(lambda: rank_endpoints() == ["basic-g0-0", "basic-g0-1"], 60, "rank endpoints")
    assert all(not any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"]["conditions"])
               for p in op.pods("basic").values())
    op.wait_phase("basic", "Initializing")
    op.kubelet.ready = lambda pod: True
    status = op.wait_phase("basic", "Ready")
    # K5: everything the operator writes survived the API server's pruning.
    for key in ("phase", "message", "observedGeneration", "replicas", "readyReplicas", "selector",
                "servedRevision", "targetRevision", "groups", "conditions", "restartBudgetGeneration"):
        assert key in status, key
    group = status["groups"][0]
    assert set(group) >= {"index", "phase", "pods", "readyPods", "revision", "restarts", "podUIDs", "message"}
    assert sorted(group["podUIDs"]) == ["basic-g0-0", "basic-g0-1"]
    assert {c["type"] for c in status["conditions"]} == {"Ready", "Progressing", "WeightsUpdated",
                                                          "GraphsCaptured", "Degraded"}
    lines = op.kubectl("get", "infd", "basic").stdout.splitlines()
    assert lines[0].split() == ["NAME", "MODEL", "TP", "REPLICAS", "READY", "PHASE", "REVISION", "AGE"]
    assert lines[1].split()[:7] == ["basic", "tiny-llama", "2", "1", "1", "Ready", "rev-a"]
    # The client Service selects the group leader only.
    def client_endpoints():
        slices = op.client.get(f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices",
                               params={"labelSelector": "kubernetes.io/service-name=basic"})["items"]
        return sorted(e["targetRef"]["name"] for s in slices for e in s.get("endpoints") or [])
    assert wait_for(lambda: client_endpoints() == ["basic-g0-0"], 60, "client endpoints")
    # Scale through the scale subresource.
    op.kubectl("scale", "infd", "basic", "--replicas", "2")
    wait_for(lambda: op.status("basic").get("readyReplicas") == 2 and op.status("basic").get("phase") == "Ready",
             90, "two ready groups")
    assert sorted(op.pods("basic")) == ["basic-g0-0", "basic-g0-1", "basic-g1-0", "basic-g1-1"]
    op.kubectl("delete", "infd", "basic", "--timeout=60s")
    wait_for(lambda: not op.kubectl("get", "statefulsets,services,pods,poddisruptionbudgets", "-o", "name",
                                    "-l", "shardline.dev/deployment=basic").stdout.strip(), 90, "children deleted")


def test_k2_image_change_never_mixes_revisions(op):
    op.kubelet.ready = lambda pod: True
    op.apply(deployment("mixed", replicas=2))
    op.wait_phase("mixed", "Ready")
    doc = deployment("mixed", replicas=2)
    doc["spec"]["runtime"]["image"] = "ghcr.io/shardline/shardline-runtime:0.2.0"
    op.apply(doc)
    seen_new_g1_before_g0_ready = []
    deleted = False
    deadline = time.monotonic() + 120
    while True:
        pods = [p for p in op.pods("mixed").values() if not p["metadata"].get("deletionTimestamp")]
        for group in ("0", "1"):
            images = {p["spec"]["containers"][0]["image"] for p in pods
                      if p["metadata"]["labels"]["shardline.dev/group"] == group}
            assert len(images) <= 1, f"group {group} runs two images: {images}"
        new = {p["metadata"]["name"] for p in pods if p["spec"]["containers"][0]["image"].endswith(":0.2.0")}
        g0_ready = {"mixed-g0-0", "mixed-g0-1"} <= new and all(
            any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])
            for p in pods if p["metadata"]["name"].startswith("mixed-g0-"))
        if any(n.startswith("mixed-g1-") for n in new) and not g0_ready:
            seen_new_g1_before_g0_ready.append(sorted(new))
        if not deleted and any(n.startswith("mixed-g0-") for n in new):
            op.kubectl("delete", "pod", "mixed-g1-0", "--wait=false")  # a rank-0 pod dies mid-rollout
            deleted = True
        if len(new) == 4 and op.status("mixed").get("phase") == "Ready":
            break
        assert time.monotonic() < deadline, f"rollout did not finish: {op.status('mixed')}\n{op.logs()}"
        time.sleep(0.3)
    assert not seen_new_g1_before_g0_ready, "group 1 rolled before group 0 was Ready again"
    assert [g["revision"] for g in op.status("mixed")["groups"]] == ["rev-a", "rev-a"]


def test_k4_crash_loop_fails_with_first_error_line_and_spec_edit_resets(op):
    line = "FileNotFoundError: model-00002-of-00002.safetensors (listed in model.safetensors.index.json) is missing"
    op.kubelet.crash = lambda pod: f"{line}\nTraceback (most recent call last):" \
        if pod["metadata"]["name"].endswith("-1") and pod["metadata"]["labels"]["shardline.dev/deployment"] == "crashy" \
        else None
    doc = deployment("crashy", restartPolicy={"maxGroupRestarts": 2, "backoffSeconds": 1})
    op.apply(doc)
    status = op.wait_phase("crashy", "Failed", timeout=120)
    assert status["groups"][0]["restarts"] == 2
    assert status["groups"][0]["message"] == line
    assert line in status["message"]
    events = op.kubectl("get", "events", "--field-selector", "involvedObject.name=crashy", "-o", "json").stdout
    reasons = [e["reason"] for e in json.loads(events)["items"]]
    assert "GroupRestart" in reasons and "GroupFailed" in reasons
    time.sleep(5)
    assert op.status("crashy")["groups"][0]["restarts"] == 2  # no restarts past the budget
    op.kubelet.crash = lambda pod: None
    doc["spec"]["restartPolicy"] = {"maxGroupRestarts": 3, "backoffSeconds": 1}
    op.apply(doc)
    status = op.wait_phase("crashy", "Ready", timeout=120)
    assert status["groups"][0]["restarts"] <= 1


def test_k4_real_runtime_crash_loop_reports_its_first_error_line(op):
    """K4 with real runtime processes (node agent): a checkpoint that is not there."""
    missing = "/var/lib/shardline/models/tiny-llama/rev-missing"
    doc = deployment("nockpt", restartPolicy={"maxGroupRestarts": 1, "backoffSeconds": 1},
                     parallelism={"tensor": 1, "gpusPerPod": 1},
                     runtime={"image": "ghcr.io/shardline/shardline-runtime:0.1.0", "dtype": "float32",
                              "maxTotalTokens": 1024, "startupTimeoutSeconds": 120})
    doc["spec"]["model"].update(path=missing, revision="rev-missing")
    del doc["spec"]["scheduling"]  # land on the node agent's nodes: real processes
    op.apply(doc)
    status = op.wait_phase("nockpt", "Failed", timeout=240)
    message = status["groups"][0]["message"]
    assert message and "\n" not in message
    assert "rev-missing" in message or "config.json" in message, message
    assert status["groups"][0]["restarts"] == 1
    op.kubectl("delete", "infd", "nockpt", "--timeout=120s", timeout=180)


def test_status_claims_nothing_before_a_leader_serves_and_lists_groups_until_their_pods_are_gone(op):
    """Issue 23's status lies, against the real API server: at creation, with no pod Ready, status
    names no served revision and does not say the weights are updated; at ``replicas: 0`` the
    group whose pods still terminate is listed (``Terminating``, ``Progressing=True``) until the
    pods are gone, then ``ScaledToZero`` with no group."""
    op.kubelet.ready = lambda pod: False
    op.apply(deployment("truth"))
    starting = op.wait_phase("truth", "Initializing")
    conditions = {c["type"]: c["status"] for c in starting["conditions"]}
    assert (starting.get("servedRevision"), conditions["WeightsUpdated"]) == ("", "False"), starting
    op.kubelet.ready = lambda pod: True
    op.wait_phase("truth", "Ready")
    op.kubelet.finish_deletion = lambda pod: False
    try:
        op.kubectl("scale", "infd", "truth", "--replicas", "0")
        draining = op.wait_phase("truth", "ScalingDown")
    finally:
        op.kubelet.finish_deletion = lambda pod: True
    progressing = next(c for c in draining["conditions"] if c["type"] == "Progressing")
    assert [(g["index"], g["phase"]) for g in draining["groups"]] == [(0, "Terminating")], draining
    assert progressing["status"] == "True", draining
    gone = op.wait_phase("truth", "ScaledToZero")
    assert gone["groups"] == [], gone
