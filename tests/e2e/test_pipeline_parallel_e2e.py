"""Pipeline parallelism over pods on the local cluster (issue 12): ``kubectl apply -f
examples/tp2-pp2.yaml`` serves a tiny Llama as TP 2 x PP 2 over two pods (pod n runs stage n,
hidden states go from pod to pod over gloo), answers through the OpenAI API, and its greedy
tokens equal transformers' own on the same checkpoint."""
from __future__ import annotations

import json
import uuid

import httpx
import pytest

from hack.scenario.examples import pipeline_example
from hack.scenario.models import MODELS_ROOT, write_tiny_model
from hack.scenario.operator_install import install_operator, operator_logs
from hack.scenario.serving import HTTP_PORT, admin_headers, chat, leader_ip, server_info
from hack.scenario.status_watch import StatusWatcher
from tests.kube_fixtures import agent_nodes_only

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow]

READY_TIMEOUT = 420
PROMPT_IDS = [1, 15, 27, 8, 42, 3, 19]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def pipeline_job(kube_cluster):
    path, doc = pipeline_example()
    model = write_tiny_model(MODELS_ROOT / "tiny-llama" / doc["spec"]["model"]["revision"], seed=1)
    install_operator(kube_cluster)
    ns = f"e2e-pp-{uuid.uuid4().hex[:6]}"
    kube_cluster.kubectl("create", "namespace", ns)
    watch = StatusWatcher(kube_cluster.client(), ns, doc["metadata"]["name"]).start()
    with agent_nodes_only(kube_cluster):
        yield kube_cluster, ns, path, doc, model, watch
    watch.stop()
    kube_cluster.kubectl("delete", "infd", "--all", "-n", ns, "--wait=false", check=False)
    kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def reference_tokens(model_path) -> list[int]:
    """Greedy continuation of ``PROMPT_IDS`` by transformers on the same checkpoint (float32)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT_IDS]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
    return out[0, len(PROMPT_IDS):].tolist()


def test_pipeline_example_serves_over_its_pods(pipeline_job):
    cluster, ns, path, doc, model, watch = pipeline_job
    name, served = doc["metadata"]["name"], doc["spec"]["model"]["name"]
    cluster.kubectl("apply", "-n", ns, "-f", str(path))
    try:
        watch.wait(lambda s: s.phase == "Ready" and s.ready_replicas == 1, READY_TIMEOUT, "pipeline example Ready")
    except Exception:
        print(operator_logs(cluster))
        raise
    pods = {p["metadata"]["name"]: p for p in
            json.loads(cluster.kubectl("get", "pods", "-n", ns, "-o", "json").stdout)["items"]}
    assert sorted(pods) == [f"{name}-g0-0", f"{name}-g0-1"]
    args = pods[f"{name}-g0-1"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pp-size") + 1] == "2" and args[args.index("--tp-size") + 1] == "2"
    assert args[args.index("--nnodes") + 1] == "2"
    status = json.loads(cluster.kubectl("get", "infd", name, "-n", ns, "-o", "json").stdout)["status"]
    assert [(r["ppRanks"], r["tpRanks"]) for r in status["groups"][0]["ranks"]] == [([0], [0, 1]), ([1], [0, 1])]
    wide = cluster.kubectl("get", "infd", name, "-n", ns, "-o", "wide").stdout.splitlines()
    assert wide[0].split()[2:4] == ["TP", "PP"] and wide[1].split()[2:4] == ["2", "2"]

    ip = leader_ip(cluster.client(), ns, name)
    admin_token = admin_headers(cluster.client(), ns, name)["Authorization"].split()[1]
    assert server_info(ip, api_key=admin_token)["pp_size"] == 2
    assert chat(ip, served, "Hello, who are you?").strip(), "an empty answer from the pipeline"
    out = httpx.post(f"http://{ip}:{HTTP_PORT}/generate", timeout=120, json={
        "input_ids": PROMPT_IDS,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}})
    assert out.status_code == 200, out.text
    assert out.json()["output_ids"] == reference_tokens(model)
