"""A real local Kubernetes 1.37.2 control plane for Shardline's tests and demo (test
infrastructure, not product): build/caching of the binaries (``build``), start/stop
(``control_plane.LocalCluster``), fake GPU nodes, and the CLI (``python3 -m hack.localcluster``).
"""
from .control_plane import LocalCluster, kubectl_binary

__all__ = ["LocalCluster", "kubectl_binary"]
