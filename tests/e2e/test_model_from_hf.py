"""Issue 25: ``examples/model-from-hf.yaml`` in the local cluster, its model on the local Hub
double (``tests/model_sources/hub_double.py``, driven only through ``huggingface_hub`` inside
the runtime and the staging Jobs; ``HF_ENDPOINT`` from ``spec.runtime.env``).

One group on ``hf://shardline/tiny-llama@main``. The branch then moves to a new commit and
the revision label changes: a staging Job resolves ``main`` and verifies every LFS file's
sha256, the in-place update follows, and the group's ``weightsDigest`` names the commit its
leader reports loading (not one the operator composed).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import yaml

from hack.scenario import rollout_fleet
from hack.scenario.models import write_revisions
from hack.scenario.operator_install import install_operator
from hack.scenario.rollout_fleet import apply
from tests.kube_fixtures import agent_nodes_only
from tests.model_sources.conftest import checkpoint_files
from tests.model_sources.hub_double import HubDouble, HubRepo

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "model-from-hf.yaml"
REPO = "shardline/tiny-llama"
READY_TIMEOUT = 420


def _deployment(hub: HubDouble, namespace: str, cache: Path) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"] = {"name": "hfm", "namespace": namespace}
    doc["spec"].update(replicas=1)
    model = doc["spec"]["model"]
    model.update(uri=f"hf://{REPO}@main", revision="c1", name="tiny-llama")
    model.pop("credentialsSecretRef")  # a public repository
    model["cache"] = {"volume": {"hostPath": {"path": str(cache), "type": "DirectoryOrCreate"}}}
    doc["spec"]["runtime"].update(dtype="float32", maxTotalTokens=4096,
                                  env=[{"name": "HF_ENDPOINT", "value": hub.endpoint}])
    return doc


@pytest.fixture(scope="module")
def fleet(kube_cluster, tmp_path_factory):
    revisions = write_revisions()
    with HubDouble() as hub:
        repo = HubRepo()
        repo.commit(checkpoint_files(revisions["rev-a"]), ref="main")
        hub.repos[REPO] = repo
        install_operator(kube_cluster)
        ns = f"e2e-hf-{uuid.uuid4().hex[:6]}"
        doc = _deployment(hub, ns, tmp_path_factory.mktemp("hf-cache"))
        with agent_nodes_only(kube_cluster):
            watch = apply(kube_cluster, doc)
            rollout_fleet.wait_ready(watch, "c1", 0, READY_TIMEOUT)
            yield {"cluster": kube_cluster, "ns": ns, "watch": watch, "repo": repo,
                   "client": kube_cluster.client()}
        watch.stop()
        kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_moved_branch_is_staged_and_the_digest_names_the_commit_the_leader_loaded(fleet):
    moved = fleet["repo"].commit(checkpoint_files(write_revisions()["rev-b"]), ref="main")
    mark = fleet["watch"].mark()
    rollout_fleet.patch(fleet["cluster"], fleet["ns"], "hfm", {"model": {"revision": "c2"}})
    rollout_fleet.wait_ready(fleet["watch"], "c2", mark, READY_TIMEOUT)
    assert _settled_digest(fleet).endswith(f";source={moved}")


def _settled_digest(fleet, timeout: float = 60.0) -> str:
    """The group's ``weightsDigest`` once recorded (the pass after Ready reads the leader)."""
    path = f"/apis/shardline.dev/v1alpha1/namespaces/{fleet['ns']}/inferencedeployments/hfm"
    deadline = time.monotonic() + timeout
    while True:
        (group,) = fleet["client"].get(path)["status"]["groups"]
        if group.get("weightsDigest") or time.monotonic() > deadline:
            return group.get("weightsDigest", "")
        time.sleep(1.0)
