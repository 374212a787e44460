"""The ``real_node_cluster`` fixture (marker ``node``): a control plane plus one real node
(containerd, runc, CNI bridge, kubelet, kube-proxy, CoreDNS) in its own network namespace, with
the images ``make images`` builds imported. Needs root, the Debian packages of
``hack/install_node_deps.sh`` and, cold, the image build (see docs/local-cluster.md)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hack.localcluster import LocalCluster, build


@pytest.fixture(scope="session")
def real_node_cluster(tmp_path_factory) -> LocalCluster:
    """Set ``SHARDLINE_NODE_CLUSTER_DIR`` to the state dir of a cluster started with
    ``python3 -m hack.localcluster up --real-node --dir DIR`` to reuse it (left running)."""
    existing = os.environ.get("SHARDLINE_NODE_CLUSTER_DIR")
    if existing:
        yield LocalCluster.load(Path(existing))
        return
    if os.geteuid() != 0:
        pytest.skip("the real node needs root (network namespaces, mounts, cgroups)")
    missing = [t for t in ("containerd", "runc", "buildah", "mmdebstrap", "iptables")
               if shutil.which(t) is None]
    if missing:
        pytest.skip(f"missing {missing}: run `make node-deps`")
    from hack.images.build import ensure_images, image_name

    build.ensure_binaries(names=build.ALL_BINARIES + build.NODE_BINARIES)
    images = {image_name(t): a for t, a in ensure_images().items()}
    cluster = LocalCluster(state_dir=tmp_path_factory.mktemp("node"), real_node=True,
                           images=images)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def operator_on_node(real_node_cluster) -> LocalCluster:
    """The chart installed with helm: the operator runs as its Deployment from the operator
    image; the tiny model revisions are written to the examples' hostPath."""
    from hack.scenario.models import write_revisions
    from hack.scenario.operator_install import install_operator

    write_revisions()
    install_operator(real_node_cluster)
    return real_node_cluster
