"""A mixture-of-experts model with expert parallelism on the local cluster (issue 13):
``kubectl apply -f examples/moe-ep2.yaml`` serves a tiny Qwen3-MoE over two pods with
``--ep-size 2``; the leader records the expert distribution and rebalances the experts in
place (no pod restarts) with unchanged greedy answers."""
from __future__ import annotations

import json
import uuid

import httpx
import pytest

from hack.scenario.examples import moe_ep2_example
from hack.scenario.models import MODELS_ROOT, write_tiny_model
from hack.scenario.operator_install import install_operator, operator_logs
from hack.scenario.serving import HTTP_PORT, admin_headers, chat, leader_ip
from hack.scenario.status_watch import StatusWatcher
from tests.kube_fixtures import agent_nodes_only

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow]

PROMPTS = ["Hello, who are you?", "Count to five."]
READY_TIMEOUT = 420


@pytest.fixture(scope="module")
def moe_job(kube_cluster):
    path, doc = moe_ep2_example()
    write_tiny_model(MODELS_ROOT / "tiny-qwen3-moe" / doc["spec"]["model"]["revision"], seed=1, arch="qwen3_moe")
    install_operator(kube_cluster)
    ns = f"e2e-moe-{uuid.uuid4().hex[:6]}"
    kube_cluster.kubectl("create", "namespace", ns)
    watch = StatusWatcher(kube_cluster.client(), ns, doc["metadata"]["name"]).start()
    with agent_nodes_only(kube_cluster):
        yield kube_cluster, ns, path, doc, watch
    watch.stop()
    kube_cluster.kubectl("delete", "infd", "--all", "-n", ns, "--wait=false", check=False)
    kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_moe_example_serves_with_expert_parallelism_and_rebalances(moe_job):
    cluster, ns, path, doc, watch = moe_job
    name, model = doc["metadata"]["name"], doc["spec"]["model"]["name"]
    cluster.kubectl("apply", "-n", ns, "-f", str(path))
    try:
        watch.wait(lambda s: s.phase == "Ready" and s.ready_replicas == 1, READY_TIMEOUT, "MoE example Ready")
    except Exception:
        print(operator_logs(cluster))
        raise
    pods = json.loads(cluster.kubectl("get", "pods", "-n", ns, "-o", "json").stdout)["items"]
    args = pods[0]["spec"]["containers"][0]["args"]
    assert args[args.index("--ep-size") + 1] == "2"
    uids = sorted(p["metadata"]["uid"] for p in pods)
    ip = leader_ip(cluster.client(), ns, name)
    url = f"http://{ip}:{HTTP_PORT}"
    # Control endpoints take the admin token the operator keeps in <name>-admin-token.
    admin = admin_headers(cluster.client(), ns, name)
    assert httpx.post(url + "/start_expert_distribution_record", timeout=60).status_code == 401
    assert httpx.post(url + "/start_expert_distribution_record", headers=admin, timeout=60).status_code == 200
    answers = [chat(ip, model, p) for p in PROMPTS]
    record = httpx.post(url + "/dump_expert_distribution_record", headers=admin, timeout=60).json()
    assert all(sum(layer) > 0 for layer in record["logical_count"])
    out = httpx.post(url + "/rebalance_experts", headers=admin, timeout=300)
    assert out.status_code == 200, out.text
    assert [chat(ip, model, p) for p in PROMPTS] == answers
    pods = json.loads(cluster.kubectl("get", "pods", "-n", ns, "-o", "json").stdout)["items"]
    assert sorted(p["metadata"]["uid"] for p in pods) == uids, "a rebalance must not restart pods"
