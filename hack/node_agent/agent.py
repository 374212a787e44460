"""The node agent: watches pods bound to its nodes and runs each one with a PodRunner.

Test infrastructure standing in for kubelet + a container runtime: pods run as local process
groups, each with its own loopback address ``127.<base>.<slot>.N`` as podIP, and StatefulSet pod
DNS names in the agent's /etc/hosts block. The manifests stay exactly what a real cluster gets.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from pathlib import Path

from hack.localcluster import pki
from hack.localcluster.rest import ApiError, RestClient

from . import service_account
from .hosts import HostsFile
from .netshim import build_shim
from .pod_runner import PodRunner, pod_tmpdir

TOKEN_EXPIRATION_S = 24 * 3600
MAX_JOIN_S = 20.0


class IpPool:
    """Addresses ``127.<base>.<slot>.2`` .. ``.254``; released ones go to the back of the
    queue so a new pod rarely inherits a just-freed address."""

    def __init__(self, base: int, slot: int):
        self._free = collections.deque(f"127.{base}.{slot}.{n}" for n in range(2, 255))
        self._lock = threading.Lock()

    def allocate(self) -> str:
        with self._lock:
            if not self._free:
                raise RuntimeError("node agent ran out of pod addresses (253 per cluster)")
            return self._free.popleft()

    def release(self, ip: str) -> None:
        with self._lock:
            self._free.append(ip)


class Agent:
    """Watch loop plus shared services for the PodRunners (API client, IPs, hosts, env)."""

    def __init__(self, kubeconfig: Path, nodes: list[str], slot: int, slot_base: int,
                 state_dir: Path, cluster_id: str):
        self.kubeconfig = kubeconfig
        self.nodes = set(nodes)
        self.state_dir = state_dir
        self.client = RestClient.from_kubeconfig(kubeconfig)
        self.ips = IpPool(slot_base, slot)
        self.hosts = HostsFile(cluster_id)
        self.bind_shim, message = build_shim(state_dir)
        self.log(message)
        self.mount_service_accounts, message = service_account.mount_namespaces_work()
        self.log(message)
        self.runners: dict[str, PodRunner] = {}
        self._lock = threading.Lock()
        self.stopping = False

    def log(self, msg: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)

    def fetch(self, kind: str, namespace: str, name: str) -> dict | None:
        """``data`` of a ConfigMap or Secret, or None when it does not exist."""
        plural = {"ConfigMap": "configmaps", "Secret": "secrets"}[kind]
        obj = self.client.get(f"/api/v1/namespaces/{namespace}/{plural}/{name}",
                              ok_missing=True)
        return None if obj is None else (obj.get("data") or {})

    def base_env(self, pod: dict, workdir: Path, pod_ip: str) -> dict[str, str]:
        """What the "image" and the pod's network provide: PATH and Python of this machine,
        HOME, a temp dir, HOSTNAME, GLOO_SOCKET_IFNAME=lo (gloo on loopback), one thread per
        process, the bind shim (wildcard listens go to ``pod_ip``), and, when the pod's
        ServiceAccount exists, a TokenRequest token of it: mounted at the standard path with
        ``KUBERNETES_SERVICE_HOST`` / ``_PORT`` (see ``service_account.py``), or as KUBECONFIG
        where mount namespaces are not allowed."""
        env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH",
                                          "VIRTUAL_ENV", "SHARDLINE_CACHE",
                                          "PYENV_ROOT", "PYENV_VERSION") if k in os.environ}
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        tmp = pod_tmpdir(pod)
        tmp.mkdir(parents=True, exist_ok=True)
        env.update(HOME=str(tmp), TMPDIR=str(tmp), HOSTNAME=pod["spec"].get(
            "hostname", pod["metadata"]["name"]), GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if self.bind_shim is not None:
            env["LD_PRELOAD"] = str(self.bind_shim)
            env["SHARDLINE_POD_IP"] = pod_ip
        if pod["spec"].get("automountServiceAccountToken", True):
            token = self._service_account_token(pod)
            ns = pod["metadata"]["namespace"]
            if token and self.mount_service_accounts:
                service_account.write_volume(workdir / "serviceaccount", token, self.client.ca_cert, ns)
                env.update(service_account.service_env(self.client.server))
            elif token:
                sa = pod["spec"].get("serviceAccountName") or "default"
                env["KUBECONFIG"] = str(pki.write_kubeconfig(
                    workdir / "kubeconfig", self.client.server, self.client.ca_cert, token,
                    user=f"system:serviceaccount:{ns}:{sa}", namespace=ns))
        return env

    def _service_account_token(self, pod: dict) -> str | None:
        meta = pod["metadata"]
        ns, sa = meta["namespace"], pod["spec"].get("serviceAccountName") or "default"
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": TOKEN_EXPIRATION_S, "boundObjectRef": {
                    "apiVersion": "v1", "kind": "Pod", "name": meta["name"],
                    "uid": meta["uid"]}}}
        try:
            resp = self.client.post(
                f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", body)
        except ApiError as e:
            if e.status != 404:
                self.log(f"{ns}/{meta['name']}: TokenRequest for {sa} failed: {e}")
            return None
        return resp["status"]["token"]

    def forget(self, uid: str) -> None:
        with self._lock:
            self.runners.pop(uid, None)

    def _handle(self, kind: str, pod: dict) -> None:
        if pod.get("spec", {}).get("nodeName") not in self.nodes:
            return
        uid = pod["metadata"]["uid"]
        with self._lock:
            runner = self.runners.get(uid)
            if kind == "DELETED":
                if runner:
                    runner.gone = True
                return
            if runner is None:
                if pod.get("status", {}).get("phase") in ("Succeeded", "Failed") and \
                        not pod["metadata"].get("deletionTimestamp"):
                    return  # finished before this agent started: nothing to run
                runner = PodRunner(self, pod)
                self.runners[uid] = runner
                runner.start()
            else:
                runner.pod = pod

    def run(self) -> None:
        """List, then watch, forever (relisting on 410 Gone or a dropped stream)."""
        ready_file = self.state_dir / "agent-ready"
        while not self.stopping:
            try:
                listing = self.client.get("/api/v1/pods")
                seen = set()
                for pod in listing["items"]:
                    seen.add(pod["metadata"]["uid"])
                    self._handle("MODIFIED", pod)
                with self._lock:
                    vanished = [r for uid, r in self.runners.items() if uid not in seen]
                for r in vanished:
                    r.gone = True
                ready_file.write_text(str(os.getpid()))
                rv = listing["metadata"]["resourceVersion"]
                while not self.stopping:
                    for event in self.client.watch("/api/v1/pods", rv):
                        if event["type"] == "ERROR":
                            raise ApiError(event["object"].get("code", 500), "WATCH",
                                           "/api/v1/pods", str(event["object"]))
                        rv = event["object"]["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self._handle(event["type"], event["object"])
            except Exception as e:  # relist on anything: 410 Gone, timeouts, restarts
                if self.stopping:
                    break
                self.log(f"watch restarting after: {e!r}"[:300])
                time.sleep(1)

    def shutdown(self) -> None:
        """Stop every pod's processes (the pods stay in the API) and drop the hosts block."""
        self.stopping = True
        with self._lock:
            runners = list(self.runners.values())
        for r in runners:
            r.stopping = True
        for r in runners:
            r.join(timeout=MAX_JOIN_S)
        self.hosts.clear()

