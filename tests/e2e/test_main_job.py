"""Shardline's main job end to end on the local cluster (issue 5, item 3).

helm installs the chart (the operator runs as the chart's Deployment pod under its own
ServiceAccount), ``kubectl apply -f examples/<tp2>.yaml`` serves a tiny model over two pods,
then: roll to revision B in place, roll to a broken checkpoint, kill rank 1, scale to two
groups, delete. The tests run in order and share one deployment.

Auth is on throughout: the example is applied with ``spec.auth.apiKeySecretRef`` pointing at a
Secret holding a user key, every chat sends that key, and every rollout goes through the admin
token the operator keeps in ``<name>-admin-token`` (the runtime refuses control calls without it).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import time
import uuid

import httpx
import openai
import pytest
import yaml

from hack.scenario.models import write_revisions
from hack.scenario.operator_install import install_operator, operator_logs
from hack.scenario.serving import HTTP_PORT, admin_headers, chat, leader_ip
from hack.scenario.status_watch import StatusWatcher
from tests.kube_fixtures import agent_nodes_only

from hack.scenario.examples import tp2_example

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow]

PROMPTS = ["Hello, who are you?", "Count to five.", "The capital of France is"]
READY_TIMEOUT = 420


class Job:
    """State shared by the ordered tests: the cluster, the CR and its status watcher."""

    def __init__(self, kube, namespace: str, name: str, model: str, revisions: dict):
        self.kube, self.namespace, self.name, self.model = kube, namespace, name, model
        self.revisions = revisions
        self.client = kube.client()
        self.watch = StatusWatcher(self.client, namespace, name).start()
        self.answers: dict[str, list[str]] = {}
        self.api_key = f"sk-e2e-{secrets.token_hex(12)}"

    def kubectl(self, *args, **kw):
        return self.kube.kubectl(*args, "-n", self.namespace, **kw)

    def patch_model(self, revision: str) -> None:
        self.patch_spec({"model": {"path": str(self.revisions[revision]), "revision": revision}})

    def patch_spec(self, spec: dict) -> None:
        self.kubectl("patch", "infd", self.name, "--type", "merge", "-p", json.dumps({"spec": spec}))

    def server_info(self, group: int = 0) -> dict:
        """The group leader's ``/get_server_info`` (read with the admin token)."""
        ip = leader_ip(self.client, self.namespace, self.name, group)
        headers = admin_headers(self.client, self.namespace, self.name)
        return httpx.get(f"http://{ip}:{HTTP_PORT}/get_server_info", headers=headers, timeout=30).json()

    def status(self) -> dict:
        return json.loads(self.kubectl("get", "infd", self.name, "-o", "json").stdout)["status"]

    def ask(self, group: int = 0) -> list[str]:
        ip = leader_ip(self.client, self.namespace, self.name, group)
        return [chat(ip, self.model, p, api_key=self.api_key) for p in PROMPTS]

    def wait_ready(self, revision: str, since: int, replicas: int = 1):
        return self.watch.wait(
            lambda s: s.phase == "Ready" and s.served_revision == revision
            and s.ready_replicas == replicas and s.observed_generation == s.generation,
            READY_TIMEOUT, f"Ready serving {revision} with {replicas} group(s)", since)

    def diagnostics(self) -> str:
        phases = "\n".join(s.line() for s in self.watch.history[-30:])
        pods = self.kubectl("get", "pods", "-o", "wide", check=False).stdout
        return f"status history:\n{phases}\npods:\n{pods}\n{operator_logs(self.kube)}"


@pytest.fixture(scope="module")
def job(kube_cluster, request):
    revisions = write_revisions()
    install_operator(kube_cluster)
    path, doc = tp2_example()
    # A namespace of its own: pod DNS names stay distinct from other sessions' clusters.
    ns = doc["metadata"].get("namespace") or f"e2e-{uuid.uuid4().hex[:6]}"
    kube_cluster.kubectl("create", "namespace", ns, check=False)
    job = Job(kube_cluster, ns, doc["metadata"]["name"], doc["spec"]["model"]["name"], revisions)
    job.example_path = path
    with agent_nodes_only(kube_cluster):
        yield job
    job.watch.stop()
    kube_cluster.kubectl("delete", "infd", "--all", "-n", ns, "--wait=false", check=False)
    kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.fixture(autouse=True)
def _report_on_failure(request, job):
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(job.diagnostics())


def test_a_apply_example_serves_chat(job):
    mark = job.watch.mark()
    job.kubectl("create", "secret", "generic", f"{job.name}-api-key", f"--from-literal=api-key={job.api_key}")
    doc = yaml.safe_load(job.example_path.read_text())
    doc["spec"]["auth"] = {"apiKeySecretRef": {"name": f"{job.name}-api-key"}}
    job.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    job.wait_ready("rev-a", mark)
    out = job.kubectl("get", "infd", job.name).stdout.splitlines()
    header, row = out[0].split(), out[1].split()
    assert header == ["NAME", "MODEL", "TP", "REPLICAS", "READY", "PHASE", "REVISION", "AGE"]
    assert row[:7] == [job.name, job.model, "2", "1", "1", "Ready", "rev-a"]
    pods = json.loads(job.kubectl("get", "pods", "-o", "json").stdout)["items"]
    assert sorted(p["metadata"]["name"] for p in pods) == [f"{job.name}-g0-0", f"{job.name}-g0-1"]
    job.answers["rev-a"] = job.ask()
    assert all(isinstance(a, str) and a for a in job.answers["rev-a"])


def test_a2_keys_guard_the_leader(job):
    ip = leader_ip(job.client, job.namespace, job.name)
    with pytest.raises(openai.AuthenticationError):
        chat(ip, job.model, PROMPTS[0], api_key="sk-wrong")
    base = f"http://{ip}:8000"
    update = {"model_path": str(job.revisions["rev-b"])}
    refused = httpx.post(f"{base}/update_weights_from_disk", json=update, timeout=30)
    assert refused.status_code == 401, refused.text
    with_user_key = httpx.post(f"{base}/update_weights_from_disk", json=update, timeout=30,
                               headers={"Authorization": f"Bearer {job.api_key}"})
    assert with_user_key.status_code == 401, "the serving key must not open the control endpoints"
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # probes need no key
    secret = json.loads(job.kubectl("get", "secret", f"{job.name}-admin-token", "-o", "json").stdout)
    assert secret["metadata"]["ownerReferences"][0]["name"] == job.name
    policies = job.kubectl("get", "networkpolicies", "-o", "name").stdout.split()
    assert f"networkpolicy.networking.k8s.io/{job.name}-g0" in policies


def test_b_roll_to_revision_b_in_place(job):
    mark = job.watch.mark()
    uids = _pod_uids(job)
    job.patch_model("rev-b")
    job.wait_ready("rev-b", mark)
    phases = job.watch.phases_since(mark)
    assert "UpdatingWeights" in phases, phases
    # RecapturingGraphs is a step exactly when the runtime recaptured (these CPU pods capture none)
    info = job.server_info()
    recaptured = info["last_weight_update"]["recapture_seconds"] > 0
    assert ("RecapturingGraphs" in phases) == recaptured, (phases, info["last_weight_update"])
    if recaptured:
        assert phases.index("UpdatingWeights") < phases.index("RecapturingGraphs")
    condition = next(c for c in job.status()["conditions"] if c["type"] == "GraphsCaptured")
    assert condition["status"] == ("True" if info["cuda_graphs"]["decode_batch_sizes"] else "False"), condition
    if not info["cuda_graphs"]["decode_batch_sizes"]:
        assert info["cuda_graphs"]["reason"] in condition["message"], (condition, info["cuda_graphs"])
    assert _pod_uids(job) == uids, "an in-place update must not restart pods"
    job.answers["rev-b"] = job.ask()
    assert job.answers["rev-b"] != job.answers["rev-a"], "revision B must change the answers"
    # A cold start on B gives the same greedy answers.
    cold = dict(yaml.safe_load(job.example_path.read_text()))
    cold["metadata"] = {"name": f"{job.name}-coldb", "namespace": job.namespace}
    cold["spec"]["model"].update(path=str(job.revisions["rev-b"]), revision="rev-b")
    job.kubectl("apply", "-f", "-", input=yaml.safe_dump(cold))
    cold_watch = StatusWatcher(job.client, job.namespace, cold["metadata"]["name"]).start()
    try:
        cold_watch.wait(lambda s: s.phase == "Ready" and s.ready_replicas == 1,
                        READY_TIMEOUT, "cold start on rev-b Ready")
        ip = leader_ip(job.client, job.namespace, cold["metadata"]["name"])
        assert [chat(ip, job.model, p) for p in PROMPTS] == job.answers["rev-b"]
    finally:
        cold_watch.stop()
        job.kubectl("delete", "infd", cold["metadata"]["name"], "--wait=false")


def test_c_broken_checkpoint_keeps_serving_b(job):
    mark = job.watch.mark()
    job.patch_model("rev-broken")
    snap = job.watch.wait(lambda s: s.conditions.get("WeightsUpdated", ("",))[0] == "False",
                          READY_TIMEOUT, "WeightsUpdated=False", mark)
    status, reason, message = snap.conditions["WeightsUpdated"]
    assert reason and message, snap.conditions
    job.watch.wait(lambda s: s.phase in ("Ready", "Degraded") and s.served_revision == "rev-b",
                   120, "settled on rev-b after the failed update", mark)
    assert job.ask() == job.answers["rev-b"]
    # Point the spec back at what is served, as a user would after a failed rollout.
    mark = job.watch.mark()
    job.patch_model("rev-b")
    job.wait_ready("rev-b", mark)


def test_d_kill_rank1_restarts_whole_group(job):
    uids = _pod_uids(job)
    pod = json.loads(job.kubectl("get", "pod", f"{job.name}-g0-1", "-o", "json").stdout)
    container_id = pod["status"]["containerStatuses"][0]["containerID"]
    assert container_id.startswith("local://"), container_id
    mark = job.watch.mark()
    os.kill(int(container_id.removeprefix("local://")), signal.SIGKILL)
    job.watch.wait(lambda s: s.phase != "Ready", 120, "the group to leave Ready", mark)
    job.wait_ready("rev-b", mark)
    new = _pod_uids(job)
    assert new[f"{job.name}-g0-0"] != uids[f"{job.name}-g0-0"], "rank 0 must be restarted too"
    assert new[f"{job.name}-g0-1"] != uids[f"{job.name}-g0-1"]
    assert job.ask() == job.answers["rev-b"]


def test_e_scale_to_two_groups(job):
    mark = job.watch.mark()
    job.kubectl("scale", "infd", job.name, "--replicas", "2")
    job.wait_ready("rev-b", mark, replicas=2)
    assert job.ask(group=0) == job.answers["rev-b"]
    assert job.ask(group=1) == job.answers["rev-b"]


def test_e2_canary_gate_with_keys_passes(job):
    """Issue 27: with ``spec.auth`` on, the canary gate sends the serving key (it got 401 with the
    admin token) and the updates go through the admin token. A bound the gate can meet passes and
    the fleet moves to rev-a. (A canary needs a second group to hold back, so this runs after the
    scale to two groups.)"""
    mark = job.watch.mark()
    job.patch_spec({"model": {"path": str(job.revisions["rev-a"]), "revision": "rev-a"},
                    "weightUpdate": {"canary": {"verify": {"prompt": "Hello", "maxTokens": 4,
                                                           "maxLatencySeconds": 120}}}})
    job.wait_ready("rev-a", mark, replicas=2)
    assert job.ask(group=1) == job.answers["rev-a"]


def test_e3_canary_gate_with_keys_fails_and_rolls_back(job):
    """The same gate with a bound it cannot meet (1 us) rolls the canary back through the admin
    token; both groups serve rev-a again, and the fleet stays Degraded until the spec changes."""
    mark = job.watch.mark()
    job.patch_spec({"model": {"path": str(job.revisions["rev-b"]), "revision": "rev-b"},
                    "weightUpdate": {"canary": {"verify": {"prompt": "Hello", "maxTokens": 4,
                                                           "maxLatencySeconds": 0.000001}}}})
    snap = job.watch.wait(lambda s: s.conditions.get("WeightsUpdated", ("",))[0] == "False"
                          and "rolled back" in s.conditions["WeightsUpdated"][2], READY_TIMEOUT,
                          "the canary rolled back", mark)
    assert "failed verification" in snap.conditions["WeightsUpdated"][2], snap.conditions
    job.watch.wait(lambda s: s.served_revision == "rev-a" and s.ready_replicas == 2 and s.phase == "Degraded",
                   120, "both groups back on rev-a", mark)
    assert job.ask(group=0) == job.answers["rev-a"]


def test_f_delete_removes_all_children(job):
    job.kubectl("delete", "infd", job.name, "--timeout=120s", timeout=180)
    deadline = time.monotonic() + 180
    while True:
        left = job.kubectl("get", "statefulsets,services,pods,poddisruptionbudgets,secrets,networkpolicies", "-o",
                           "name", "-l", f"shardline.dev/deployment={job.name}").stdout.split()
        if not left:
            break
        assert time.monotonic() < deadline, f"children left after delete: {left}"
        time.sleep(1)


def _pod_uids(job) -> dict[str, str]:
    pods = json.loads(job.kubectl("get", "pods", "-o", "json").stdout)["items"]
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods
            if p["metadata"]["name"].startswith(f"{job.name}-g")}
