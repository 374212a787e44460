"""TP=2 over two runtime containers under the real kubelet (issue 21, stage 3): the ranks meet
through the headless rank Service's DNS name (CoreDNS), and clients reach the group through the
client Service's ClusterIP (kube-proxy)."""
from __future__ import annotations

import uuid

import pytest

from hack.scenario.examples import tp2_example
from tests.node.deployments import Served, adapted, chat_in_node

pytestmark = [pytest.mark.node, pytest.mark.slow]

NS = f"node-tp2-{uuid.uuid4().hex[:5]}"
PROMPT = "The capital of France is"


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
