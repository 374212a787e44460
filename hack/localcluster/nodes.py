"""Fake GPU nodes: Node objects whose capacity includes ``nvidia.com/gpu``, so the real
kube-scheduler places GPU pods (and leaves pods over capacity Pending with
"Insufficient nvidia.com/gpu"). The node agent runs what gets bound to them."""
from __future__ import annotations

import datetime

from .rest import ApiError, RestClient


def node_manifest(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64", "nvidia.com/gpu.present": "true",
                "shardline.dev/local-cluster": "true"}}}


def node_status(gpus: int) -> dict:
    """``status`` of a Ready node with ``gpus`` GPUs, 16 CPUs, 64 GiB and 110 pods."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    resources = {"cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": str(gpus),
                 "ephemeral-storage": "100Gi"}
    return {"capacity": resources, "allocatable": resources,
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "shardline node agent", "lastHeartbeatTime": now,
                            "lastTransitionTime": now}],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
            "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux",
                         "kubeletVersion": "v1.37.2", "kubeProxyVersion": "",
                         "containerRuntimeVersion": "shardline-node-agent://0.1",
                         "kernelVersion": "", "osImage": "local processes",
                         "bootID": "", "machineID": "", "systemUUID": ""}}


def create_gpu_nodes(client: RestClient, names: tuple[str, ...], gpus: int) -> None:
    """Create (or reuse) each node and set its status through the status subresource."""
    for name in names:
        try:
            client.post("/api/v1/nodes", node_manifest(name))
        except ApiError as e:
            if e.status != 409:
                raise
        client.merge_patch(f"/api/v1/nodes/{name}/status", {"status": node_status(gpus)})
