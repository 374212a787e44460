"""The chart's InferencePool and endpoint picker objects against the REAL Gateway API Inference
Extension CRDs (v1.5.0, from its Go module's config/crd/bases; marker ``cluster``): the API
server validates them with the CRDs' own schemas in a server-side dry run."""
from __future__ import annotations

import copy

import pytest
import yaml

from hack.gie.pool import install_crds, render_pool

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAMESPACE = "gie-crds"


@pytest.fixture(scope="module")
def gie_crds(kube_cluster):
    try:
        install_crds(kube_cluster)
    except RuntimeError as exc:
        pytest.fail(f"cannot install the GIE CRDs: {exc}")
    kube_cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    return kube_cluster


def dry_run(cluster, docs, check=True):
    return cluster.kubectl("apply", "--dry-run=server", "-n", NAMESPACE, "-f", "-", check=check,
                           input=yaml.safe_dump_all(docs))


def test_every_pool_object_passes_the_api_server(gie_crds):
    docs = render_pool(gie_crds, "llama", NAMESPACE)
    out = dry_run(gie_crds, docs).stdout
    assert out.count("(server dry run)") == len(docs), out


def test_the_pool_is_served_as_the_v1_inferencepool(gie_crds):
    (pool,) = [d for d in render_pool(gie_crds, "llama", NAMESPACE) if d["kind"] == "InferencePool"]
    out = dry_run(gie_crds, [pool]).stdout
    assert "inferencepool.inference.networking.k8s.io/llama created (server dry run)" in out


def test_a_pool_without_an_endpoint_picker_is_rejected(gie_crds):
    (pool,) = [d for d in render_pool(gie_crds, "llama", NAMESPACE) if d["kind"] == "InferencePool"]
    bad = copy.deepcopy(pool)
    del bad["spec"]["endpointPickerRef"]
    proc = dry_run(gie_crds, [bad], check=False)
    assert (proc.returncode != 0, "endpointPickerRef" in proc.stderr) == (True, True), proc.stderr
