"""pytest plugin: the session-scoped ``kube_cluster`` fixture (marker ``cluster``).

It builds (on a cache miss, 10-20 min cold) and starts etcd, kube-apiserver,
kube-controller-manager and kube-scheduler 1.37.2 on loopback, creates fake GPU nodes and
starts the node agent; at the end of the session every process is stopped by PID.

Set ``SHARDLINE_CLUSTER_DIR`` to the state directory of a cluster started with
``python3 -m hack.localcluster up --dir DIR`` to reuse it (it is then left running).
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

from hack.localcluster import LocalCluster, build


def pytest_collection_finish(session):
    """Build the cluster binaries before the first test when a selected test needs the
    cluster: a cold build (10-20 min) must not count against one test's timeout."""
    if any({"gie_pool", "gateway_rollout"} & set(getattr(item, "fixturenames", ())) for item in session.items):
        _build_epp()  # the GIE endpoint picker (hack/gie): tens of minutes cold
    if os.environ.get("SHARDLINE_CLUSTER_DIR"):
        return
    if any("kube_cluster" in getattr(item, "fixturenames", ()) for item in session.items):
        if build.missing_binaries():
            try:
                with contextlib.redirect_stdout(sys.__stdout__):
                    build.ensure_binaries()
            except RuntimeError as e:
                raise pytest.UsageError(f"cannot build the local cluster binaries: {e}") from e


def _build_epp() -> None:
    from hack.gie import ensure_epp

    try:
        with contextlib.redirect_stdout(sys.__stdout__):
            ensure_epp()
    except RuntimeError as e:
        raise pytest.UsageError(f"cannot build the GIE endpoint picker: {e}") from e


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory) -> LocalCluster:
    """A running local cluster: ``.kubeconfig`` (Path), ``.server`` (URL), ``.env`` (dict with
    KUBECONFIG), ``.kubectl(*args, input=None, check=True)``, ``.helm(*args)``."""
    existing = os.environ.get("SHARDLINE_CLUSTER_DIR")
    if existing:
        yield LocalCluster.load(Path(existing))
        return
    cluster = LocalCluster(state_dir=tmp_path_factory.mktemp("kube"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@contextlib.contextmanager
def agent_nodes_only(cluster: LocalCluster):
    """Cordon, for the duration, every node the node agent does not serve (e.g. the operator
    tests' fake-kubelet node), so pods of the block only land where processes really run."""
    client = cluster.client()
    foreign = [n["metadata"]["name"] for n in client.get("/api/v1/nodes")["items"]
               if n["metadata"]["name"] not in cluster.nodes
               and not n.get("spec", {}).get("unschedulable")]
    for name in foreign:
        client.merge_patch(f"/api/v1/nodes/{name}", {"spec": {"unschedulable": True}})
    try:
        yield
    finally:
        for name in foreign:
            client.merge_patch(f"/api/v1/nodes/{name}", {"spec": {"unschedulable": None}})
        client.close()
