"""One pod's life on the node agent: address, DNS names, volumes, ServiceAccount kubeconfig,
init containers then containers, status reports, and finishing the pod when it is deleted."""
from __future__ import annotations

import copy
import os
import shutil
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from hack.localcluster.rest import ApiError

from . import service_account
from .container import Container, now_rfc3339
from .env import (
    EnvError,
    container_argv,
    container_env,
    empty_dir_paths,
    host_path_paths,
    remap_paths,
)
from .hosts import pod_dns_names

if TYPE_CHECKING:
    from .agent import Agent

TICK_S = 0.25
# The kubelet honours a pod's grace period; so does the agent, up to this bound against a runaway
# spec (Shardline renders preStop 5 s + --drain-timeout 30 s + 25 s = 60 s by default). A lower
# cap SIGKILLed draining leaders with requests still running (issue 23).
MAX_GRACE_S = 120.0
SHUTDOWN_GRACE_S = 5.0  # agent stopping: the cluster is going away


class PodRunner(threading.Thread):
    """Runs one pod until it is deleted (or the agent stops)."""

    def __init__(self, agent: Agent, pod: dict):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.agent = agent
        self.pod = pod
        self.uid = meta["uid"]
        self.key = f"{meta['namespace']}/{meta['name']}"
        self.path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        self.gone = False
        self.stopping = False
        self.ip = ""
        self.workdir = agent.state_dir / f"{meta['namespace']}_{meta['name']}_{self.uid[:8]}"
        policy = pod["spec"].get("restartPolicy", "Always")
        grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        self.init = [Container(c, self.workdir, "OnFailure" if policy != "Never" else "Never",
                               grace) for c in pod["spec"].get("initContainers", [])]
        self.containers = [Container(c, self.workdir, policy, grace)
                           for c in pod["spec"]["containers"]]
        self.start_time = now_rfc3339()
        self.last_status: dict | None = None
        self.config_error = ""
        self.base_env: dict[str, str] = {}

    def log(self, msg: str) -> None:
        self.agent.log(f"{self.key}: {msg}")

    def run(self) -> None:
        try:
            self._setup()
            while not self.gone and not self.stopping:
                if self.pod["metadata"].get("deletionTimestamp"):
                    break
                try:
                    self._tick()
                except httpx.TransportError as exc:  # the API server did not answer in time
                    # (overloaded): the kubelet keeps its pods and reports again; so does the agent
                    self.log(f"API server unreachable, reporting again next tick: {exc!r}")
                time.sleep(TICK_S)
            self._finish(delete=not self.stopping and not self.gone)
        except Exception:  # the agent must never die with one pod
            self.log("runner crashed:\n" + traceback.format_exc())
            self._finish(delete=False)

    def _setup(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ip = self.agent.ips.allocate()
        self.agent.hosts.set(self.uid, self.ip, pod_dns_names(self.pod))
        self._prepare_volumes()
        self.base_env = self.agent.base_env(self.pod, self.workdir, self.ip)
        self.log(f"starting on {self.pod['spec'].get('nodeName')} with podIP {self.ip}")

    def _prepare_volumes(self) -> None:
        vols = {v["name"]: v for v in self.pod["spec"].get("volumes", [])}
        for c in self.pod["spec"].get("initContainers", []) + self.pod["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                v = vols.get(m["name"], {})
                hp = v.get("hostPath")
                if hp is None:
                    continue
                if hp.get("type") == "DirectoryOrCreate":
                    Path(hp["path"]).mkdir(parents=True, exist_ok=True)
                if os.path.normpath(hp["path"]) != os.path.normpath(m["mountPath"]):
                    self.log(f"warning: hostPath {hp['path']} is mounted at {m['mountPath']}; "
                             "local processes see host paths only")

    def _pod_view(self) -> dict:
        pod = copy.deepcopy(self.pod)
        pod.setdefault("status", {}).update({
            "podIP": self.ip, "podIPs": [{"ip": self.ip}], "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}]})
        return pod

    def _start(self, c: Container) -> None:
        try:
            env = container_env(self._pod_view(), c.spec, self.agent.fetch)
            env = remap_paths(env, empty_dir_paths(self.pod, c.spec, pod_tmpdir(self.pod)))
            env = remap_paths(env, host_path_paths(self.pod, c.spec))
            argv = container_argv(c.spec, env)
        except (EnvError, ApiError, KeyError) as e:
            msg = f"container {c.name}: {e}"
            if msg != self.config_error:
                self.log(msg)
            self.config_error = msg
            c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
            return
        self.config_error = ""
        volume = self.workdir / "serviceaccount"
        if (volume / "token").exists():
            argv = service_account.mounted_argv(volume, argv)
        full = dict(self.base_env)
        full["SHARDLINE_TERMINATION_LOG"] = str(c.termination_log)
        full.update(env)
        c.start(argv, full, self.ip)
        self.log(f"container {c.name} started (pid {c.proc.pid if c.proc else '-'}): "
                 f"{' '.join(argv)[:300]}")

    def _advance(self, c: Container) -> None:
        if c.proc is None and "waiting" in c.state:
            self._start(c)
            return
        if c.poll():
            term = c.state["terminated"]
            self.log(f"container {c.name} exited {term['exitCode']}"
                     + (f": {term.get('message', '')[:200]}" if term.get("message") else ""))
        c.run_probes()
        if c.poll():
            self.log(f"container {c.name} restarted by a failed probe")
        if c.wants_restart():
            c.begin_restart()
            self._start(c)

    def _tick(self) -> None:
        for c in self.init:
            if c.done and c.state.get("terminated", {}).get("exitCode") == 0:
                continue
            if not c.done:
                self._advance(c)
            break
        else:
            for c in self.containers:
                if not c.done:
                    self._advance(c)
        self._report()

    def _phase(self) -> str:
        for c in self.init:
            term = c.state.get("terminated", {})
            if c.done and term.get("exitCode") != 0:
                return "Failed"
            if not (c.done and term.get("exitCode") == 0):
                return "Pending"
        if any(c.proc is None and c.restart_count == 0 and "waiting" in c.state
               for c in self.containers):
            return "Pending"
        if all(c.done for c in self.containers):
            ok = all(c.state["terminated"]["exitCode"] == 0 for c in self.containers)
            return "Succeeded" if ok else "Failed"
        return "Running"

    def _report(self) -> None:
        phase = self._phase()
        inits_done = all(c.done and c.state.get("terminated", {}).get("exitCode") == 0
                         for c in self.init)
        ready = phase == "Running" and all(c.ready for c in self.containers)

        def cond(kind: str, ok: bool) -> dict:
            return {"type": kind, "status": "True" if ok else "False"}

        status = {
            "phase": phase, "podIP": self.ip, "podIPs": [{"ip": self.ip}],
            "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "startTime": self.start_time,
            "conditions": [cond("PodReadyToStartContainers", True),
                           cond("Initialized", inits_done), cond("ContainersReady", ready),
                           cond("Ready", ready)],
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.init:
            status["initContainerStatuses"] = [c.status() for c in self.init]
        comparable = _without_times(status)
        if comparable == self.last_status:
            return
        now = now_rfc3339()
        for c in status["conditions"]:
            c["lastTransitionTime"] = now
        if self.last_status is not None:
            old = {c["type"]: c["status"] for c in self.last_status["conditions"]}
            status["conditions"] = [c for c in status["conditions"]
                                    if old.get(c["type"]) != c["status"]]
        try:
            self.agent.client.strategic_patch(
                self.path + "/status", {"metadata": {"uid": self.uid}, "status": status})
            self.last_status = comparable
        except ApiError as e:
            if e.status in (404, 409):
                self.gone = e.status == 404 or self.gone
            else:
                self.log(f"status patch failed: {e}")

    def _finish(self, delete: bool) -> None:
        meta = self.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds",
                         self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        grace = 0.0 if self.gone else min(float(grace), SHUTDOWN_GRACE_S if self.stopping
                                          else MAX_GRACE_S)
        # preStop sleep hooks (the only kind Shardline renders) run first, within the grace period.
        pre_stop = max((float(((c.get("lifecycle") or {}).get("preStop") or {}).get("sleep", {}).get("seconds", 0))
                        for c in self.pod["spec"].get("containers", [])), default=0.0)
        if pre_stop > 0 and grace > 0 and not self.stopping:
            time.sleep(min(pre_stop, grace))
            grace = max(grace - pre_stop, 0.1)
        for c in self.init + self.containers:
            c.kill(grace)
        if delete:
            try:
                self.agent.client.delete(self.path, {
                    "apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                    "preconditions": {"uid": self.uid}}, ok_missing=True)
                self.log("finished and deleted")
            except ApiError as e:
                if e.status != 409:
                    self.log(f"final delete failed: {e}")
        self.agent.hosts.remove(self.uid)
        if self.ip:
            self.agent.ips.release(self.ip)
        if not os.environ.get("SHARDLINE_AGENT_KEEP_POD_DIRS"):
            shutil.rmtree(pod_tmpdir(self.pod), ignore_errors=True)
        self.agent.forget(self.uid)


def _without_times(status: dict) -> dict:
    """The status without timestamps that change every report (for change detection)."""
    out = copy.deepcopy(status)
    for c in out["containerStatuses"] + out.get("initContainerStatuses", []):
        waiting = c["state"].get("waiting")
        if waiting and waiting.get("reason") == "CrashLoopBackOff":
            waiting["message"] = waiting["message"].split(" (")[0]
    return out


def pod_tmpdir(pod: dict) -> Path:
    """The pod's HOME and TMPDIR: short on purpose (``/tmp/shardline-pod-<uid>``), because
    Unix socket paths made under it (ZMQ ``ipc://``) must stay under 108 bytes."""
    return Path(tempfile.gettempdir()) / f"shardline-pod-{pod['metadata']['uid'][:13]}"
