"""The node's network namespace: created with ``ip netns``, joined to the host by a veth pair.

Node processes enter it with ``nsenter --net=/run/netns/NAME`` (network namespace only), never
``ip netns exec``: that also unshares the mount namespace and remounts /sys, which would hide
the cgroup mounts and keep the kubelet's volume mounts from containerd.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from .config import NodeLayout


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def in_netns(layout: NodeLayout, argv: list[str]) -> list[str]:
    """``argv`` run inside the node's network namespace (and the host's other namespaces)."""
    return ["nsenter", f"--net=/run/netns/{layout.netns}", "--", *argv]


def create(layout: NodeLayout) -> None:
    """Create the namespace (replacing a stale one of the same slot), the veth pair, addresses,
    loopback, a default route to the host, forwarding and bridge netfilter (kube-proxy's rules must see
    pod-to-pod traffic on the bridge). Raises subprocess.CalledProcessError on failure."""
    delete(layout)
    _ip("netns", "add", layout.netns)
    _ip("link", "add", layout.host_veth, "type", "veth", "peer", "name", layout.node_veth)
    _ip("link", "set", layout.node_veth, "netns", layout.netns)
    _ip("addr", "add", f"{layout.host_ip}/30", "dev", layout.host_veth)
    _ip("link", "set", layout.host_veth, "up")
    ns = ["-n", layout.netns]
    _ip(*ns, "addr", "add", f"{layout.node_ip}/30", "dev", layout.node_veth)
    _ip(*ns, "link", "set", layout.node_veth, "up")
    _ip(*ns, "link", "set", "lo", "up")
    # Locally sent packets need a route before kube-proxy's OUTPUT rules rewrite a ClusterIP.
    _ip(*ns, "route", "add", "default", "via", layout.host_ip)
    for key, value in (("net.ipv4.ip_forward", "1"),
                       ("net.bridge.bridge-nf-call-iptables", "1"),
                       ("net.ipv4.conf.all.route_localnet", "1")):
        subprocess.run(in_netns(layout, ["sysctl", "-qw", f"{key}={value}"]),
                       capture_output=True, text=True, check=True)


def delete(layout: NodeLayout) -> None:
    """Remove the namespace (its veth end and bridge go with it) and the host's veth end."""
    if Path(f"/run/netns/{layout.netns}").exists():
        _ip("netns", "delete", layout.netns, check=False)
    _ip("link", "delete", layout.host_veth, check=False)
