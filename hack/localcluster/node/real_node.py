"""A real Kubernetes node in the cluster's network namespace: containerd (with runc and the CNI
bridge), the kubelet, kube-proxy and CoreDNS, each a process started and stopped by PID.

``RealNode.start`` takes a started control plane (its API server listening on the host side of
the veth pair, see :mod:`.config`) and returns once the node is Ready, advertises its fake GPUs
and serves cluster DNS; ``stop`` removes every pod sandbox through the CRI, stops the
processes, unmounts what the kubelet and containerd left under the state directory, removes the
per-cluster cgroups and deletes the namespace.
"""
from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .. import build, processes
from ..rest import ApiError, RestClient
from . import config, netns
from .config import NodeLayout
from .images import ensure_pause_archive, import_archives

NODE_LABELS = {"nvidia.com/gpu.present": "true", "shardline.dev/local-cluster": "true"}
# Stop order: nothing may start new containers while the sandboxes are removed.
STOP_ORDER = ("kubelet", "kube-proxy", "coredns", "containerd")


def _log(msg: str) -> None:
    print(f"[realnode {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class RealNode:
    """One node. ``spawn(name, argv)`` starts a process and records its PID (the cluster's
    bookkeeping); ``kubeconfig`` is an admin kubeconfig whose server the node can reach."""

    layout: NodeLayout
    kubeconfig: Path
    spawn: Callable[[str, list[str]], int]
    gpus: int = 8
    images: dict[str, Path] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    PROCESSES = STOP_ORDER

    @property
    def bins(self) -> Path:
        return build.bin_dir()

    def crictl(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        """Run crictl against this node's containerd; return stdout."""
        proc = subprocess.run([str(self.bins / "crictl"), "--runtime-endpoint",
                               f"unix://{self.layout.containerd_socket}", *args],
                              capture_output=True, text=True, timeout=timeout, check=False)
        if check and proc.returncode:
            raise RuntimeError(f"crictl {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def exec_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run in the node's network namespace (to reach pod and Service IPs)."""
        return netns.in_netns(self.layout, argv)

    def start(self, client: RestClient) -> RealNode:
        """Start containerd, import the images, then the kubelet, kube-proxy and CoreDNS."""
        started = time.monotonic()
        self._write_configs()
        self._run("containerd", ["containerd", "--config", str(self._path("containerd.toml"))])
        self._wait(lambda: self.layout.containerd_socket.exists(), "containerd socket", 60)
        archives = {config.PAUSE_IMAGE: ensure_pause_archive(), **self.images}
        import_archives(archives, self.layout.containerd_socket)
        _log(f"containerd up, images imported ({time.monotonic() - started:.0f} s)")
        self._create_cgroup_root()
        self._run("kubelet", [
            str(self.bins / "kubelet"), f"--config={self._path('kubelet.yaml')}",
            f"--kubeconfig={self.kubeconfig}", f"--hostname-override={self.layout.name}",
            f"--node-ip={self.layout.node_ip}", f"--root-dir={self._path('kubelet')}",
            f"--cert-dir={self._path('kubelet-pki')}",
            "--node-labels=" + ",".join(f"{k}={v}" for k, v in NODE_LABELS.items()), "--v=1"])
        self._wait(lambda: self._node_ready(client), f"node {self.layout.name} Ready", 180)
        self._advertise_gpus(client)
        _log(f"kubelet registered {self.layout.name} ({time.monotonic() - started:.0f} s)")
        self._run("kube-proxy", [str(self.bins / "kube-proxy"),
                                 f"--config={self._path('kube-proxy.yaml')}", "--v=1"])
        self._start_dns(client)
        _log(f"node ready in {time.monotonic() - started:.0f} s")
        return self

    def _path(self, name: str) -> Path:
        return self.layout.state_dir / name

    def _write_configs(self) -> None:
        lay = self.layout
        (lay.state_dir / "cni" / "net.d").mkdir(parents=True, exist_ok=True)
        self._path("containerd.toml").write_text(config.containerd_config(lay))
        (lay.state_dir / "cni" / "net.d" / "10-shardline.conflist").write_text(
            config.cni_conflist(lay))
        self._path("kubelet.yaml").write_text(config.kubelet_config(lay))
        self._path("resolv.conf").write_text(f"nameserver {config.CLUSTER_DNS}\n")
        self._path("kube-proxy.yaml").write_text(
            config.kube_proxy_config(lay, self.kubeconfig))
        self._path("Corefile").write_text(config.corefile(self.kubeconfig))

    def _run(self, name: str, argv: list[str]) -> None:
        self.pids[name] = self.spawn(name, netns.in_netns(self.layout, argv))

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, pid in self.pids.items():
                if not processes.alive(pid):
                    raise RuntimeError(f"{name} exited while waiting for {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: not after {timeout:.0f} s")
            time.sleep(0.5)

    def _node_ready(self, client: RestClient) -> bool:
        try:
            node = client.get(f"/api/v1/nodes/{self.layout.name}")
        except ApiError:
            return False
        conditions = node.get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def _advertise_gpus(self, client: RestClient) -> None:
        """Fake GPUs: PATCH ``nvidia.com/gpu`` into the node's capacity and allocatable, the
        documented way to advertise an extended resource; the kubelet keeps it."""
        gpus = {"nvidia.com/gpu": str(self.gpus)}
        client.merge_patch(f"/api/v1/nodes/{self.layout.name}/status",
                           {"status": {"capacity": gpus, "allocatable": gpus}})

    def _start_dns(self, client: RestClient) -> None:
        for path, body in (("/api/v1/namespaces/kube-system/services", config.dns_service()),
                           ("/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices",
                            config.dns_endpoints(self.layout))):
            try:
                client.post(path, body)
            except ApiError as e:
                if e.status != 409:
                    raise
        self._run("coredns", [str(self.bins / "coredns"), "-conf", str(self._path("Corefile"))])

    def _create_cgroup_root(self) -> None:
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            if hierarchy.is_dir() and os.access(hierarchy, os.W_OK):
                (hierarchy / self.layout.cgroup_root.lstrip("/")).mkdir(exist_ok=True)

    def stop(self, stop_pid: Callable[[str], None]) -> None:
        """Remove every pod sandbox (their containers get SIGTERM, then SIGKILL), stop the node
        processes by PID (``stop_pid(name)``), clean mounts, cgroups and the namespace."""
        def stop_once(name: str) -> None:
            if self.pids.pop(name, None) is not None:
                stop_pid(name)

        if "containerd" in self.pids and self.layout.containerd_socket.exists():
            stop_once("kubelet")
            try:
                self.crictl("rmp", "--force", "--all", check=False, timeout=60)
            except (subprocess.TimeoutExpired, OSError) as e:
                _log(f"removing pod sandboxes: {e}")
        for name in STOP_ORDER:
            stop_once(name)
        self._unmount_state()
        self._remove_cgroups()
        netns.delete(self.layout)

    def _unmount_state(self) -> None:
        """Lazily unmount, deepest first, every mount under the state directory (the kubelet's
        tmpfs volumes, containerd's rootfs and shm mounts)."""
        root = str(self.layout.state_dir.resolve())
        mounts = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point == root or point.startswith(root + "/"):
                mounts.append(point)
        for point in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)

    def _remove_cgroups(self) -> None:
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            top = hierarchy / self.layout.cgroup_root.lstrip("/")
            if not top.is_dir():
                continue
            for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                try:
                    d.rmdir()
                except OSError:
                    pass
            try:
                top.rmdir()
            except OSError:
                pass
