"""Issue 25: a deployment whose model lives in S3 (a real versitygw) in the local cluster,
staged on the nodes before any group pauses.

``examples/model-from-s3.yaml`` as two groups of one pod, keys from a Secret, its model cache a
``hostPath`` (node-local, shared by the staging Jobs and the runtime pods; on the node agent
every fake node is this one host, so the nodes share the directory). Then, under client
traffic with no failed request: change the uri to a new revision (phase ``Staging``: a staging
Job per node downloads and verifies it, then the in-place update reads it from the cache);
point it at a prefix that does not exist (staging fails with NotFound, no group pauses, the old
revision keeps serving); serve a prefix whose stored bytes were corrupted (staging fails the
checksum before any group pauses); stage a larger revision under a download rate cap and read
each node's live bytes, total and rate from status while its Job runs.
"""

from __future__ import annotations

import time
import uuid

import pytest

from hack.s3server import S3Server
from hack.scenario import rollout_fleet
from hack.scenario.models import write_revisions
from hack.scenario.operator_install import install_operator
from hack.scenario.rollout_fleet import apply
from hack.scenario.s3_models import BUCKET, s3_client, s3_deployment, upload_revisions
from hack.scenario.traffic import Traffic
from tests.kube_fixtures import agent_nodes_only

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow]

READY_TIMEOUT = 420
# rev-d: rev-b plus 24 MiB of padding, staged at 2 MiB/s (about 12 s), so a running
# Job's progress annotation (every 5 s) shows in status at least once.
PADDING_BYTES = 24 << 20
MAX_BYTES_PER_SECOND = 2 << 20


@pytest.fixture(scope="module")
def fleet(kube_cluster, tmp_path_factory):
    revisions = write_revisions()
    with S3Server(tmp_path_factory.mktemp("s3")) as s3:
        upload_revisions(s3, revisions, {"rev-a": "rev-a", "rev-b": "rev-b", "rev-c": "rev-a",
                                         "rev-d": "rev-b"})
        s3_client(s3).put_object(Bucket=BUCKET, Key="tiny/rev-d/padding.dat",
                                 Body=bytes(PADDING_BYTES))
        install_operator(kube_cluster)
        ns = f"e2e-s3-{uuid.uuid4().hex[:6]}"
        cache = tmp_path_factory.mktemp("model-cache")
        volume = {"hostPath": {"path": str(cache), "type": "DirectoryOrCreate"}}
        doc = s3_deployment(kube_cluster, s3, ns, "s3m", "rev-a", volume)
        doc["spec"]["runtime"].setdefault("env", []).append(
            {"name": "SHARDLINE_DOWNLOAD_MAX_BYTES_PER_SECOND", "value": str(MAX_BYTES_PER_SECOND)})
        with agent_nodes_only(kube_cluster):
            watch = apply(kube_cluster, doc)
            state = {"cluster": kube_cluster, "ns": ns, "watch": watch, "s3": s3,
                     "client": kube_cluster.client()}
            rollout_fleet.wait_ready(watch, "rev-a", 0, READY_TIMEOUT)
            yield state
        watch.stop()
        kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def _patch_uri(fleet, prefix: str) -> int:
    mark = fleet["watch"].mark()
    rollout_fleet.patch(fleet["cluster"], fleet["ns"], "s3m",
                        {"model": {"uri": f"s3://{BUCKET}/tiny/{prefix}", "revision": prefix}})
    return mark


def _traffic(fleet) -> Traffic:
    return Traffic(fleet["client"], fleet["ns"], "s3m", "tiny-llama")


def _staging_failed(fleet, mark: int):
    return fleet["watch"].wait(
        lambda s: s.conditions.get("Staging", ("", ""))[0] == "False"
        and s.conditions["Staging"][1] not in ("Staged", "Staging"),
        READY_TIMEOUT, "staging failed", mark)


def _status(fleet) -> dict:
    path = f"/apis/shardline.dev/v1alpha1/namespaces/{fleet['ns']}/inferencedeployments/s3m"
    return fleet["client"].get(path)["status"]


def test_new_s3_revision_is_staged_then_rolls_in_under_traffic_without_a_failed_request(fleet):
    with _traffic(fleet) as client:
        mark = _patch_uri(fleet, "rev-b")
        rollout_fleet.wait_ready(fleet["watch"], "rev-b", mark, READY_TIMEOUT)
    phases = fleet["watch"].phases_since(mark)
    assert client.failures == [], rollout_fleet.diagnostics(fleet["cluster"], fleet["watch"])
    assert phases.index("Staging") < phases.index("UpdatingWeights"), phases


def test_staged_revision_is_recorded_in_each_groups_digest(fleet):
    status = _status(fleet)
    digests = [g.get("weightsDigest", "") for g in status["groups"]]
    assert digests == [f"{digests[0].split(';')[0]};source={status['staging']['resolvedRevision']}"] * 2


def test_missing_s3_prefix_fails_staging_and_keeps_the_old_revision_serving(fleet):
    with _traffic(fleet) as client:
        mark = _patch_uri(fleet, "rev-missing")
        snap = _staging_failed(fleet, mark)
    assert snap.conditions["Staging"][1] == "NotFound"
    assert snap.served_revision == "rev-b"
    assert "UpdatingWeights" not in fleet["watch"].phases_since(mark)
    assert client.failures == []


def test_corrupt_object_fails_the_checksum_before_any_group_pauses(fleet):
    stored = fleet["s3"].object_path(BUCKET, "tiny/rev-c/model.safetensors")
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF
    stored.write_bytes(bytes(data))
    mark = _patch_uri(fleet, "rev-c")
    snap = _staging_failed(fleet, mark)
    assert snap.conditions["Staging"][1] == "ChecksumMismatch"
    assert "UpdatingWeights" not in fleet["watch"].phases_since(mark)
    leaders = rollout_fleet.leader_server_infos(fleet["client"], fleet["ns"], "s3m").values()
    loaded = [(info.get("last_weight_update") or {}).get("model_path", "") for info in leaders]
    assert not [path for path in loaded if "rev-c" in path], loaded  # no group started loading


def _live_progress(fleet, timeout: float = 90.0) -> dict:
    """The first ``status.staging.nodes[]`` item of a running Job with partial progress (polled:
    progress changes only a condition's message, which the watcher does not record)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for item in (_status(fleet).get("staging") or {}).get("nodes") or []:
            if item["state"] == "Running" and 0 < item.get("bytesDone", 0) < item.get("bytesTotal", 0):
                return item
        time.sleep(0.5)
    raise TimeoutError(f"no live staging progress in {timeout:.0f} s: {_status(fleet).get('staging')}")


def test_running_staging_job_shows_live_bytes_total_and_rate(fleet):
    _patch_uri(fleet, "rev-d")
    item = _live_progress(fleet)
    assert item["bytesTotal"] >= PADDING_BYTES
    assert 0 < item["bytesPerSecond"] <= MAX_BYTES_PER_SECOND * 1.1
