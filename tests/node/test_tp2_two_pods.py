"""TP=2 over two runtime containers under the real kubelet (issue 21, stage 3): the ranks meet
through the headless rank Service's DNS name (CoreDNS), and clients reach the group through the
client Service's ClusterIP (kube-proxy). Then, in order on the same deployment: an in-place
weight rollout, a group restart after ``crictl stop`` of rank 1, and a Restart rollout whose
pods the kubelet stops with the real preStop hook and SIGTERM."""
from __future__ import annotations

import json
import uuid

import pytest

from hack.scenario.examples import tp2_example
from hack.scenario.models import MODELS_ROOT
from shardline_operator.render.pod_template import PRE_STOP_SECONDS
from tests.node.deployments import PodEnds, Served, adapted, chat_in_node

pytestmark = [pytest.mark.node, pytest.mark.slow]

NS = f"node-tp2-{uuid.uuid4().hex[:5]}"
PROMPT = "The capital of France is"
REVISIONS = MODELS_ROOT / "tiny-llama"


@pytest.fixture(scope="module")
def tp2(operator_on_node):
    operator_on_node.kubectl("create", "namespace", NS, check=False)
    _, doc = tp2_example()
    served = Served(operator_on_node, adapted(doc, NS))
    served.apply()
    served.wait_ready(doc["spec"]["model"]["revision"])
    yield served
    served.delete()
    operator_on_node.kubectl("delete", "namespace", NS, "--wait=false", check=False)


def test_rank1_resolves_rank0_through_the_headless_service(tp2):
    rank0 = f"{tp2.name}-g0-0.{tp2.name}-g0-ranks.{NS}.svc"
    out = tp2.kubectl("exec", f"{tp2.name}-g0-1", "--", "python3", "-c",
                      f"import socket;print(socket.gethostbyname('{rank0}'))").stdout
    assert out.strip() == tp2.pod(0)["status"]["podIP"]


def test_rank1_was_told_the_dns_name_not_an_ip(tp2):
    args = tp2.pod(1)["spec"]["containers"][0]["args"]
    addr = args[args.index("--dist-init-addr") + 1]
    assert addr.startswith(f"{tp2.name}-g0-0.{tp2.name}-g0-ranks.{NS}.svc:"), addr


def test_chat_through_the_client_service_cluster_ip(operator_on_node, tp2):
    service = tp2.client.get(f"/api/v1/namespaces/{NS}/services/{tp2.name}")
    answer = chat_in_node(operator_on_node, service["spec"]["clusterIP"],
                          tp2.doc["spec"]["model"]["name"], PROMPT)
    assert answer


def test_cluster_ip_answers_as_the_leader_does(operator_on_node, tp2):
    model = tp2.doc["spec"]["model"]["name"]
    service = tp2.client.get(f"/api/v1/namespaces/{NS}/services/{tp2.name}")
    via_service = chat_in_node(operator_on_node, service["spec"]["clusterIP"], model, PROMPT)
    via_pod = chat_in_node(operator_on_node, tp2.pod(0)["status"]["podIP"], model, PROMPT)
    assert via_service == via_pod


def test_in_place_rollout_keeps_the_pods_and_changes_the_answer(operator_on_node, tp2):
    model = tp2.doc["spec"]["model"]["name"]
    leader = tp2.pod(0)["status"]["podIP"]
    before, uids = chat_in_node(operator_on_node, leader, model, PROMPT), tp2.pod_uids()
    mark = tp2.watch.mark()
    tp2.kubectl("patch", "infd", tp2.name, "--type", "merge", "-p", json.dumps(
        {"spec": {"model": {"path": str(REVISIONS / "rev-b"), "revision": "rev-b"}}}))
    tp2.wait_ready("rev-b", mark)
    phases = tp2.watch.phases_since(mark)
    assert phases.index("UpdatingWeights") < phases.index("RecapturingGraphs"), phases
    assert tp2.pod_uids() == uids, "an in-place update must not restart pods"
    assert chat_in_node(operator_on_node, leader, model, PROMPT) != before


def test_crictl_stop_of_rank1_restarts_the_whole_group(operator_on_node, tp2):
    uids = tp2.pod_uids()
    listed = json.loads(operator_on_node.node.crictl(
        "ps", "--label", f"io.kubernetes.pod.name={tp2.name}-g0-1", "-o", "json"))["containers"]
    mark = tp2.watch.mark()
    operator_on_node.node.crictl("stop", listed[0]["id"])
    tp2.watch.wait(lambda s: s.phase != "Ready", 120, "the group to leave Ready", mark)
    tp2.wait_ready("rev-b", mark)
    new = tp2.pod_uids()
    assert new[f"{tp2.name}-g0-0"] != uids[f"{tp2.name}-g0-0"], "rank 0 must restart too"


def test_restart_rollout_drains_the_leader(operator_on_node, tp2):
    # strategy Restart: the pods are deleted; the kubelet runs the preStop sleep, then SIGTERM,
    # on which the leader drains and exits 0 well inside the grace period (no SIGKILL: 137).
    ends = PodEnds(tp2)
    leader_uid = tp2.pod(0)["metadata"]["uid"]
    mark = tp2.watch.mark()
    tp2.kubectl("patch", "infd", tp2.name, "--type", "merge", "-p", json.dumps(
        {"spec": {"weightUpdate": {"strategy": "Restart"},
                  "model": {"path": str(REVISIONS / "rev-a"), "revision": "rev-a"}}}))
    tp2.wait_ready("rev-a", mark)
    ends.stop()
    end = ends.ends[leader_uid]
    assert end["terminated"]["exitCode"] == 0, end
    assert end["terminated"]["seen_at"] - end["deleted_at"] >= PRE_STOP_SECONDS, end
