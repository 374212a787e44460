"""The chart's Gateway API Inference Extension objects (``inferencePool.enabled``): an
InferencePool (inference.networking.k8s.io/v1, GIE v1.5.0) over each listed deployment's
routable group leaders and its endpoint picker, as the upstream standalone chart renders it.
The real CRDs and the real EPP against them: tests/cluster/test_gie_crds.py and
tests/e2e/test_gie_epp_e2e.py."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from shardline_operator.render.services import routable_leader_labels
from shardline_runtime.entrypoints.metrics import ServingMetrics

CHART = Path(__file__).resolve().parents[2] / "charts" / "shardline"
POOLED = ["--set", "inferencePool.enabled=true",
          "--set", "inferencePool.deployments[0].name=llama", "--set", "inferencePool.deployments[0].namespace=models",
          "--set", "inferencePool.deployments[1].name=qwen", "--set", "inferencePool.deployments[1].namespace=lab"]


def render(helm, extra):
    out = helm("template", "shardline", str(CHART), "--namespace", "shardline-system", *extra).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def pool_docs(helm, *extra: str, namespace="models"):
    return {d["kind"]: d for d in render(helm, [*POOLED, *extra]) if d["metadata"].get("namespace") == namespace}


def test_no_gateway_objects_by_default(helm):
    kinds = {d["kind"] for d in render(helm, [])}
    assert "InferencePool" not in kinds


def test_lint_strict_with_pools(helm):
    helm("lint", "--strict", str(CHART), *POOLED)


def test_each_listed_deployment_gets_a_pool_and_its_picker(helm):
    for namespace in ("models", "lab"):
        assert sorted(pool_docs(helm, namespace=namespace)) == ["ConfigMap", "Deployment", "InferencePool", "Role",
                                                                  "RoleBinding", "Service", "ServiceAccount"]


def test_core_objects_validate_strictly(helm):
    for doc in pool_docs(helm).values():
        if doc["kind"] != "InferencePool":  # a CRD: validated by the API server in the cluster tier
            kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_pool_selects_the_routable_leaders_the_client_service_selects(helm):
    pool = pool_docs(helm)["InferencePool"]
    assert pool["spec"]["selector"]["matchLabels"] == routable_leader_labels("llama")


def test_pool_targets_the_runtime_http_port(helm):
    assert pool_docs(helm)["InferencePool"]["spec"]["targetPorts"] == [{"number": 8000}]


def test_pool_is_the_v1_api_v1_5_ships(helm):
    assert pool_docs(helm)["InferencePool"]["apiVersion"] == "inference.networking.k8s.io/v1"


def test_endpoint_picker_ref_is_the_epp_service_port(helm):
    docs = pool_docs(helm)
    ref = docs["InferencePool"]["spec"]["endpointPickerRef"]
    ports = {p["port"] for p in docs["Service"]["spec"]["ports"]}
    assert (ref["name"], ref["port"]["number"] in ports) == (docs["Service"]["metadata"]["name"], True)


def test_epp_serves_the_pool_of_its_namespace(helm):
    args = pool_docs(helm, namespace="lab")["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--pool-")] == [
        "--pool-name=qwen", "--pool-namespace=lab", "--pool-group=inference.networking.k8s.io"]


def test_epp_role_only_reads(helm):
    role = pool_docs(helm)["Role"]
    assert {v for rule in role["rules"] for v in rule["verbs"]} == {"get", "list", "watch"}


def test_epp_scrapes_the_names_the_runtime_exports(helm):
    config = yaml.safe_load(pool_docs(helm)["ConfigMap"]["data"]["config.yaml"])
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["parameters"]["engineConfigs"]
    specs = [engine[k] for k in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec",
                                 "cacheInfoSpec")]
    metrics = ServingMetrics("m", num_gpu_blocks=64, block_size=1, max_lora=2)
    exported = {f.name for f in text_string_to_metric_families(metrics.render().decode())}
    assert [s for s in specs if s not in exported] == []


def test_epp_config_uses_the_shardline_engine_by_default(helm):
    config = yaml.safe_load(pool_docs(helm)["ConfigMap"]["data"]["config.yaml"])
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    assert extractor["parameters"]["defaultEngine"] == "shardline"


@pytest.mark.parametrize("extra,message", [
    ([], "inferencePool.deployments"),
    (["--set", "inferencePool.deployments[0].name=llama"], "namespace"),
])
def test_enabled_without_a_complete_deployment_fails_naming_the_field(helm, extra, message):
    proc = helm("template", "s", str(CHART), "--set", "inferencePool.enabled=true", *extra, check=False)
    assert (proc.returncode != 0, message in proc.stderr) == (True, True), proc.stderr


def test_epp_prefix_window_is_set_in_tokens(helm):
    # The runtime exports block_size 1: the EPP's default of 256 blocks would hash only the
    # first 256 tokens (1 KiB of text), so prompts sharing them would all look alike.
    default = yaml.safe_load(pool_docs(helm)["ConfigMap"]["data"]["config.yaml"])
    config = yaml.safe_load(pool_docs(helm, "--set", "inferencePool.epp.prefixMatchTokens=2048")
                            ["ConfigMap"]["data"]["config.yaml"])
    assert [p.get("parameters") for p in default["plugins"] if p["type"] == "prefix-cache-scorer"] == [
        {"autoTune": True, "maxPrefixTokensToMatch": 4096}]
    (scorer,) = [p for p in config["plugins"] if p["type"] == "prefix-cache-scorer"]
    assert scorer["parameters"] == {"autoTune": True, "maxPrefixTokensToMatch": 2048}
