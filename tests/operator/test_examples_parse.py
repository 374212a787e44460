"""examples/: each InferenceDeployment satisfies the CRD's schema and the operator's parser."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from shardline_operator.render import render_children
from shardline_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def spec_schema():
    crd = yaml.safe_load((ROOT / "crds" / "inferencedeployment.yaml").read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_the_three_examples_exist():
    docs = {p.name: yaml.safe_load(p.read_text()) for p in EXAMPLES}
    shapes = sorted((d["spec"]["parallelism"]["tensor"], d["spec"]["parallelism"]["gpusPerPod"]) for d in docs.values())
    assert (1, 1) in shapes and (2, 1) in shapes
    pipelines = [d["spec"]["parallelism"] for d in docs.values() if d["spec"]["parallelism"].get("pipeline", 1) > 1]
    assert {"tensor": 2, "pipeline": 2, "gpusPerPod": 2} in pipelines, "examples/tp2-pp2.yaml: TP 2 x PP 2 over two pods"
    assert docs["weight-rollout.yaml"]["metadata"]["name"] == docs["tp2-two-pods.yaml"]["metadata"]["name"]
    assert docs["weight-rollout.yaml"]["spec"]["model"]["revision"] != docs["tp2-two-pods.yaml"]["spec"]["model"]["revision"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_valid(path):
    for doc in yaml.safe_load_all(path.read_text()):
        assert doc["apiVersion"] == "shardline.dev/v1alpha1" and doc["kind"] == "InferenceDeployment"
        jsonschema.Draft4Validator(spec_schema()).validate(doc["spec"])
        spec = parse_spec(doc["metadata"]["name"], "examples", "uid", doc["spec"])
        for child in render_children(spec):
            kubernetes_validate.validate(child, "1.37.0", strict=True)
