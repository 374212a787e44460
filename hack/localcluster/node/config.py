"""Configuration files of the real node (pure: text in, text out; tested without root).

Addresses of one cluster (its *slot*, see ``control_plane.acquire_slot``): the node lives in a
network namespace of its own, joined to the host by a veth pair ``10.254.<slot>.1`` (host side,
where the API server listens) / ``10.254.<slot>.2`` (node side: the node's InternalIP, the
kubelet's and CoreDNS's address). Inside the namespace, pods get ``POD_CIDR`` on the CNI bridge,
and kube-proxy's rules serve ``SERVICE_CIDR``. Because every cluster has its own namespace,
these two ranges are the same for all clusters and never meet.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

POD_CIDR = "10.88.0.0/16"
SERVICE_CIDR = "10.0.0.0/24"
CLUSTER_DNS = "10.0.0.10"
CLUSTER_DOMAIN = "cluster.local"
CNI_BIN_DIR = "/usr/lib/cni"
BRIDGE = "cni0"
PAUSE_IMAGE = "localhost/shardline-pause:1.0"


@dataclass(frozen=True)
class NodeLayout:
    """Names, addresses and paths of one cluster's node."""

    slot: int
    name: str
    state_dir: Path

    @property
    def netns(self) -> str:
        return f"shardline-{self.slot}"

    @property
    def host_ip(self) -> str:
        return f"10.254.{self.slot}.1"

    @property
    def node_ip(self) -> str:
        return f"10.254.{self.slot}.2"

    @property
    def host_veth(self) -> str:
        return f"sl{self.slot}h"

    @property
    def node_veth(self) -> str:
        return f"sl{self.slot}n"

    @property
    def containerd_socket(self) -> Path:
        return self.state_dir / "containerd" / "containerd.sock"

    @property
    def cgroup_root(self) -> str:
        """The kubelet's ``cgroupRoot``: kubepods of two clusters never share a cgroup."""
        return f"/shardline-{self.slot}"


def containerd_config(layout: NodeLayout) -> str:
    """containerd 1.6 ``config.toml`` (version 2): private root, state and socket; the CRI
    plugin with runc (cgroupfs, as the kubelet), the local pause image, and the CNI bridge;
    ``oom_score_adj`` never below containerd's own (see below)."""
    d = layout.state_dir / "containerd"
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return "\n".join([
        "version = 2",
        f'root = "{d / "root"}"',
        f'state = "{d / "state"}"',
        "[grpc]",
        f'  address = "{layout.containerd_socket}"',
        "[ttrpc]",
        f'  address = "{layout.containerd_socket}.ttrpc"',
        '[plugins."io.containerd.internal.v1.opt"]',
        f'  path = "{d / "opt"}"',
        f"[{cri}]",
        f'  sandbox_image = "{PAUSE_IMAGE}"',
        "  enable_unprivileged_ports = true",
        # The kubelet asks -998 for sandboxes; lowering oom_score_adj needs CAP_SYS_RESOURCE,
        # which root here lacks (runc: "failed to update /proc/self/oom_score_adj").
        "  restrict_oom_score_adj = true",
        "  enable_unprivileged_icmp = true",
        f"[{cri}.containerd]",
        '  snapshotter = "overlayfs"',
        '  default_runtime_name = "runc"',
        f"[{cri}.containerd.runtimes.runc]",
        '  runtime_type = "io.containerd.runc.v2"',
        f"[{cri}.containerd.runtimes.runc.options]",
        "  SystemdCgroup = false",
        f"[{cri}.cni]",
        f'  bin_dir = "{CNI_BIN_DIR}"',
        f'  conf_dir = "{layout.state_dir / "cni" / "net.d"}"',
        "",
    ])


def cni_conflist(layout: NodeLayout) -> str:
    """The pod network: a ``bridge`` (gateway, hairpin, masquerade out of the pod range) with
    ``host-local`` addresses kept in the cluster's state directory, then ``portmap``."""
    return json.dumps({
        "cniVersion": "1.0.0",
        "name": "shardline",
        "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True,
             "hairpinMode": True,
             "ipam": {"type": "host-local", "dataDir": str(layout.state_dir / "cni" / "ipam"),
                      "ranges": [[{"subnet": POD_CIDR}]], "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }, indent=2)


def kubelet_config(layout: NodeLayout) -> str:
    """``KubeletConfiguration``: cgroup v1 allowed (``failCgroupV1: false``; the machine has a
    v1/v2 hybrid), ``cgroupfs`` driver under a per-cluster ``cgroupRoot``, the cluster DNS,
    anonymous ``AlwaysAllow`` on its port (reachable only from this machine; the API server
    needs it for logs and exec), no image garbage collection (images are imported, not pulled)
    and eviction thresholds low enough for a shared development disk."""
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": layout.cgroup_root,
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "address": layout.node_ip,
        "healthzBindAddress": "127.0.0.1",
        "readOnlyPort": 0,
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDNS": [CLUSTER_DNS],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(layout.state_dir / "resolv.conf"),
        "failSwapOn": False,
        "oomScoreAdj": 0,
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "serializeImagePulls": False,
        "registerNode": True,
        "nodeStatusUpdateFrequency": "5s",
        "syncFrequency": "5s",
        "fileCheckFrequency": "5s",
        "shutdownGracePeriod": "0s",
        "localStorageCapacityIsolation": True,
        "protectKernelDefaults": False,
        "makeIPTablesUtilChains": False,
    }
    return yaml.safe_dump(config, sort_keys=False)


def kube_proxy_config(layout: NodeLayout, kubeconfig: Path) -> str:
    """``KubeProxyConfiguration`` in iptables mode. ``conntrack.maxPerCore: 0`` leaves the
    conntrack table size alone (it is not settable inside a network namespace)."""
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "hostnameOverride": layout.name,
        "clusterCIDR": POD_CIDR,
        "bindAddress": layout.node_ip,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "conntrack": {"maxPerCore": 0, "min": 0},
        "iptables": {"masqueradeAll": False, "syncPeriod": "5s", "minSyncPeriod": "0s"},
    }
    return yaml.safe_dump(config, sort_keys=False)


def corefile(kubeconfig: Path) -> str:
    """CoreDNS serving pod and Service names of ``cluster.local`` from the API server (no
    upstream: nothing outside this machine resolves here)."""
    return (
        f".:53 {{\n    errors\n    health 127.0.0.1:8080\n    ready 127.0.0.1:8181\n"
        f"    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{\n"
        f"        kubeconfig {kubeconfig} local\n"
        f"        pods insecure\n        fallthrough in-addr.arpa ip6.arpa\n        ttl 5\n    }}\n"
        f"    cache 5\n}}\n"
    )


def dns_service() -> dict:
    """The ``kube-dns`` Service at ``CLUSTER_DNS`` (no selector: CoreDNS is a node process and
    its EndpointSlice is written by the node, see :func:`dns_endpoints`)."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "kube-dns", "namespace": "kube-system",
                     "labels": {"k8s-app": "kube-dns"}},
        "spec": {"clusterIP": CLUSTER_DNS, "ports": [
            {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53}]},
    }


def dns_endpoints(layout: NodeLayout) -> dict:
    """EndpointSlice of ``kube-dns``: CoreDNS on the node's address."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "kube-dns-node", "namespace": "kube-system",
                     "labels": {"kubernetes.io/service-name": "kube-dns",
                                "endpointslice.kubernetes.io/managed-by": "shardline-node"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [layout.node_ip], "conditions": {"ready": True}}],
        "ports": [{"name": "dns", "port": 53, "protocol": "UDP"},
                  {"name": "dns-tcp", "port": 53, "protocol": "TCP"}],
    }
