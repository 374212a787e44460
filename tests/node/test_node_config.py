"""The real node's configuration files and pause image, without starting anything."""
from __future__ import annotations

import io
import json
import tarfile
import tomllib
from pathlib import Path

import yaml

from hack.localcluster.node import config
from hack.localcluster.node.config import NodeLayout
from hack.localcluster.node.images import pause_archive

LAYOUT = NodeLayout(slot=7, name="gpu-node-0", state_dir=Path("/tmp/c7/node"))


def kubelet():
    return yaml.safe_load(config.kubelet_config(LAYOUT))


def test_kubelet_accepts_the_hybrid_cgroup_layout():
    assert kubelet()["failCgroupV1"] is False


def test_kubelet_uses_the_cgroupfs_driver():
    assert kubelet()["cgroupDriver"] == "cgroupfs"


def test_each_cluster_has_its_own_cgroup_root():
    assert kubelet()["cgroupRoot"] == "/shardline-7"


def test_kubelet_talks_to_the_clusters_own_containerd():
    assert kubelet()["containerRuntimeEndpoint"] == "unix:///tmp/c7/node/containerd/containerd.sock"


def test_pods_resolve_through_the_cluster_dns_service():
    assert kubelet()["clusterDNS"] == [config.CLUSTER_DNS]


def test_containerd_runs_runc_without_systemd_cgroups():
    toml = tomllib.loads(config.containerd_config(LAYOUT))
    runc = toml["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["runc"]
    assert runc["options"]["SystemdCgroup"] is False


def test_containerd_sandbox_image_is_the_local_pause():
    toml = tomllib.loads(config.containerd_config(LAYOUT))
    assert toml["plugins"]["io.containerd.grpc.v1.cri"]["sandbox_image"] == config.PAUSE_IMAGE


def test_cni_bridge_allocates_the_pod_range():
    bridge = json.loads(config.cni_conflist(LAYOUT))["plugins"][0]
    assert bridge["ipam"]["ranges"] == [[{"subnet": config.POD_CIDR}]]


def test_cni_addresses_are_kept_in_the_clusters_state_dir():
    bridge = json.loads(config.cni_conflist(LAYOUT))["plugins"][0]
    assert bridge["ipam"]["dataDir"] == "/tmp/c7/node/cni/ipam"


def test_slots_get_disjoint_veth_addresses():
    other = NodeLayout(slot=8, name="gpu-node-0", state_dir=Path("/tmp/c8/node"))
    assert {LAYOUT.host_ip, LAYOUT.node_ip}.isdisjoint({other.host_ip, other.node_ip})


def test_interface_names_fit_the_kernel_limit():
    wide = NodeLayout(slot=200, name="n", state_dir=Path("/x"))
    assert max(len(wide.host_veth), len(wide.node_veth)) <= 15


def test_dns_endpoints_point_at_the_node():
    slice_ = config.dns_endpoints(LAYOUT)
    assert slice_["endpoints"][0]["addresses"] == [LAYOUT.node_ip]


def test_pause_archive_names_the_image_and_runs_pause():
    archive = tarfile.open(fileobj=io.BytesIO(pause_archive(b"\x7fELF")))
    (manifest,) = json.loads(archive.extractfile("manifest.json").read())
    image_config = json.loads(archive.extractfile(manifest["Config"]).read())
    assert manifest["RepoTags"] == [config.PAUSE_IMAGE]
    assert image_config["config"]["Entrypoint"] == ["/pause"]


def test_pause_archive_layer_digest_matches():
    import hashlib

    archive = tarfile.open(fileobj=io.BytesIO(pause_archive(b"\x7fELF")))
    (manifest,) = json.loads(archive.extractfile("manifest.json").read())
    layer = archive.extractfile("layer.tar").read()
    image_config = json.loads(archive.extractfile(manifest["Config"]).read())
    assert image_config["rootfs"]["diff_ids"] == [f"sha256:{hashlib.sha256(layer).hexdigest()}"]


def test_sandbox_oom_score_is_never_below_containerds():
    """runc failed every sandbox ("failed to update /proc/self/oom_score_adj: Permission
    denied"): the kubelet asks -998 and root here lacks CAP_SYS_RESOURCE."""
    toml = tomllib.loads(config.containerd_config(LAYOUT))
    assert toml["plugins"]["io.containerd.grpc.v1.cri"]["restrict_oom_score_adj"] is True
