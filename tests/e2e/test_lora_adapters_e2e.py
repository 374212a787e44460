"""LoRA adapters managed by the operator on the local cluster (issue 15): apply
``examples/lora-adapters.yaml`` with one adapter, add a second, remove the first, chatting with
each at each step; no pod restarts, and ``status.loraAdapters`` counts the loaded groups.

Auth is on (issue 27): the deployment has ``spec.auth.apiKeySecretRef``, so every chat sends the
serving key, and the operator's adapter list/load/unload calls must go through its admin token
(the runtime refuses control calls with the serving key and serving calls without one)."""
from __future__ import annotations

import json
import secrets
import uuid

import openai
import pytest
import yaml

from hack.scenario.examples import inference_deployments
from hack.scenario.models import MODELS_ROOT, write_tiny_model
from hack.scenario.operator_install import install_operator, operator_logs
from hack.scenario.serving import chat as serving_chat
from hack.scenario.serving import leader_ip
from hack.scenario.status_watch import StatusWatcher
from tests.kube_fixtures import agent_nodes_only

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow]

READY_TIMEOUT = 420
PROMPT = "Hello, who are you?"


def lora_example():
    for path, doc in inference_deployments():
        if doc.get("spec", {}).get("loraAdapters"):
            return path, doc
    raise LookupError("no example in examples/ has spec.loraAdapters")


@pytest.fixture(scope="module")
def lora_job(kube_cluster):
    from shardline_runtime.lora.tiny_adapter import write_tiny_adapter

    path, doc = lora_example()
    model_dir = write_tiny_model(MODELS_ROOT / "tiny-llama" / doc["spec"]["model"]["revision"], seed=1)
    for seed, name in ((1, "tiny-a"), (2, "tiny-b")):
        if not (MODELS_ROOT / "adapters" / name / "adapter_config.json").exists():
            write_tiny_adapter(MODELS_ROOT / "adapters" / name, model_dir, seed=seed)
    install_operator(kube_cluster)
    ns = f"e2e-lora-{uuid.uuid4().hex[:6]}"
    kube_cluster.kubectl("create", "namespace", ns)
    key = f"sk-lora-{secrets.token_hex(8)}"
    kube_cluster.kubectl("create", "secret", "generic", "lora-api-key", f"--from-literal=api-key={key}", "-n", ns)
    doc = dict(doc, spec=dict(doc["spec"], auth={"apiKeySecretRef": {"name": "lora-api-key"}}))
    watch = StatusWatcher(kube_cluster.client(), ns, doc["metadata"]["name"]).start()
    with agent_nodes_only(kube_cluster):
        yield kube_cluster, ns, key, doc, watch
    watch.stop()
    kube_cluster.kubectl("delete", "infd", "--all", "-n", ns, "--wait=false", check=False)
    kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_adapters_are_added_and_removed_in_place(lora_job):
    cluster, ns, key, doc, watch = lora_job
    name, model = doc["metadata"]["name"], doc["spec"]["model"]["name"]

    def chat(ip, served, prompt):
        return serving_chat(ip, served, prompt, api_key=key)

    def loaded(names):
        def check(s):
            entries = {e["name"]: e for e in s.lora_adapters}
            return s.phase == "Ready" and sorted(entries) == sorted(names) and \
                all(e.get("loadedGroups") == 1 and not e.get("error") for e in entries.values())
        return check

    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    try:
        watch.wait(loaded(["tiny-a"]), READY_TIMEOUT, "tiny-a loaded")
    except Exception:
        print(operator_logs(cluster))
        raise
    ip = leader_ip(cluster.client(), ns, name)
    uids = sorted(p["metadata"]["uid"] for p in json.loads(cluster.kubectl("get", "pods", "-n", ns, "-o", "json").stdout)["items"])
    with pytest.raises(openai.AuthenticationError):  # the adapter serves behind the deployment's key
        serving_chat(ip, "tiny-a", PROMPT)
    base, a = chat(ip, model, PROMPT), chat(ip, "tiny-a", PROMPT)
    assert a != base

    in_pod = doc["spec"]["loraAdapters"][0]["path"].rsplit("/", 1)[0]  # the adapters directory on the model volume
    adapters = doc["spec"]["loraAdapters"] + [{"name": "tiny-b", "path": f"{in_pod}/tiny-b"}]
    patch = json.dumps({"spec": {"loraAdapters": adapters}})
    cluster.kubectl("patch", "infd", name, "-n", ns, "--type", "merge", "-p", patch)
    watch.wait(loaded(["tiny-a", "tiny-b"]), 120, "tiny-b added")
    b = chat(ip, "tiny-b", PROMPT)
    assert chat(ip, "tiny-a", PROMPT) == a and b not in (a, base) and chat(ip, model, PROMPT) == base

    cluster.kubectl("patch", "infd", name, "-n", ns, "--type", "merge", "-p", json.dumps({"spec": {"loraAdapters": adapters[1:]}}))
    watch.wait(loaded(["tiny-b"]), 120, "tiny-a removed")
    assert chat(ip, "tiny-b", PROMPT) == b and chat(ip, model, PROMPT) == base
    with pytest.raises(openai.BadRequestError) as removed:  # docs/api.md: an unknown adapter is a 400 naming model
        chat(ip, "tiny-a", PROMPT)
    assert removed.value.status_code == 400
    body = removed.value.body  # the error object, or the whole reply, depending on the client version
    assert body.get("error", body)["param"] == "model", body
    pods = json.loads(cluster.kubectl("get", "pods", "-n", ns, "-o", "json").stdout)["items"]
    assert sorted(p["metadata"]["uid"] for p in pods) == uids, "adapter changes must not restart pods"
