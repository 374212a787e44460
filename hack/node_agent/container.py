"""One container run as a local process group: start, probes, exit, restart backoff, and its
``containerStatuses`` entry (state, lastState, ready, started, restartCount)."""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import time
from pathlib import Path

from .probes import ProbeState, run_probe

BACKOFF_INITIAL_S = 1.0
BACKOFF_MAX_S = 20.0
BACKOFF_RESET_AFTER_S = 60.0
MESSAGE_LIMIT = 4096


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Container:
    """A container of a pod. ``tick()`` advances it; ``status()`` reports it.

    Args:
        spec: the container's entry from ``pod.spec.containers``.
        workdir: per-pod directory for logs and the termination-message file.
    """

    def __init__(self, spec: dict, workdir: Path, restart_policy: str, grace_s: float = 30.0):
        self.spec = spec
        self.grace_s = grace_s
        self.name = spec["name"]
        self.workdir = workdir
        self.restart_policy = restart_policy
        self.log_path = workdir / f"{self.name}.log"
        self.termination_log = workdir / f"{self.name}.termination-log"
        self.proc: subprocess.Popen | None = None
        self.started_at = ""
        self.start_mono = 0.0
        self.restart_count = 0
        self.state: dict = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict = {}
        self.ready = False
        self.started = False
        self.backoff_until = 0.0
        self.backoff_s = BACKOFF_INITIAL_S
        self.probes: dict[str, ProbeState] = {}
        self.done = False  # terminated and not going to restart
        self.argv: list[str] = []
        self.env: dict[str, str] = {}
        self.pod_ip = ""

    def start(self, argv: list[str], env: dict[str, str], pod_ip: str) -> None:
        """Start the process (own session, stdout+stderr appended to the container log)."""
        self.argv, self.env, self.pod_ip = argv, env, pod_ip
        self.termination_log.write_text("")
        cwd = self.spec.get("workingDir") or str(self.workdir)
        Path(cwd).mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"--- {now_rfc3339()} start: {argv}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
            except OSError as e:
                self.proc = None
                self._terminated(128, "StartError", f"failed to start {argv[0]!r}: {e}")
                return
        # Lets the cluster's stop() find a process the agent could not end (by PID, checked).
        (self.workdir / f"{self.name}.pid").write_text(str(self.proc.pid))
        self.started_at = now_rfc3339()
        self.start_mono = time.monotonic()
        self.state = {"running": {"startedAt": self.started_at}}
        self.ready = False
        self.started = "startupProbe" not in self.spec
        self.probes = {kind: ProbeState(self.spec[key], kind, self.start_mono)
                       for kind, key in (("startup", "startupProbe"),
                                         ("liveness", "livenessProbe"),
                                         ("readiness", "readinessProbe")) if key in self.spec}

    def _message(self, exit_code: int) -> str:
        text = ""
        if self.termination_log.exists():
            text = self.termination_log.read_text(errors="replace")[:MESSAGE_LIMIT]
        fallback = self.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError"
        if not text and fallback and exit_code != 0 and self.log_path.exists():
            lines = self.log_path.read_text(errors="replace").splitlines()[-80:]
            text = "\n".join(lines)[-2048:]
        return text.strip()

    def _terminated(self, exit_code: int, reason: str, message: str = "",
                    sig: int | None = None) -> None:
        term = {"exitCode": exit_code, "reason": reason,
                "startedAt": self.started_at or now_rfc3339(), "finishedAt": now_rfc3339()}
        if message:
            term["message"] = message
        if sig:
            term["signal"] = sig
        self.state = {"terminated": term}
        self.ready = False
        restart = (self.restart_policy == "Always"
                   or (self.restart_policy == "OnFailure" and exit_code != 0))
        self.done = not restart
        if restart:
            if self.start_mono and time.monotonic() - self.start_mono > BACKOFF_RESET_AFTER_S:
                self.backoff_s = BACKOFF_INITIAL_S
            self.backoff_until = time.monotonic() + self.backoff_s
            self.backoff_s = min(self.backoff_s * 2, BACKOFF_MAX_S)

    def kill(self, grace_s: float) -> None:
        """SIGTERM the process group, SIGKILL after ``grace_s``; records the exit."""
        if self.proc is None or self.proc.poll() is not None:
            self.poll()
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=max(grace_s, 0.1))
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._signal(signal.SIGKILL)  # children left in the group
        self.restart_policy = "Never"
        self.poll()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _restart_for_probe(self, kind: str, message: str) -> None:
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=min(self.grace_s, 10.0))
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self._signal(signal.SIGKILL)
        with open(self.log_path, "ab") as log:
            log.write(f"--- {now_rfc3339()} {kind} probe failed: {message}; killed\n".encode())
        self.poll()

    def poll(self) -> bool:
        """Record an exit if the process ended; True if it did (just now)."""
        if self.proc is None or "running" not in self.state:
            return False
        rc = self.proc.poll()
        if rc is None:
            return False
        # Kill anything the main process left behind in its group.
        self._signal(signal.SIGKILL)
        if rc < 0:
            self._terminated(128 - rc, "Error", self._message(128 - rc), sig=-rc)
        else:
            self._terminated(rc, "Completed" if rc == 0 else "Error", self._message(rc))
        return True

    def run_probes(self) -> None:
        """Run due probes; restart the container when startup or liveness fails."""
        if self.proc is None or "running" not in self.state:
            return
        now = time.monotonic()
        startup = self.probes.get("startup")
        if startup and not self.started:
            if startup.due(now):
                startup.record(*run_probe(startup.probe, self.spec, self.pod_ip, self.env), now)
                if startup.passing:
                    self.started = True
                    for kind in ("liveness", "readiness"):
                        if kind in self.probes:
                            self.probes[kind].next_at = now
                elif startup.failing:
                    self._restart_for_probe("startup", startup.last_message)
            return
        live = self.probes.get("liveness")
        if live and live.due(now):
            live.record(*run_probe(live.probe, self.spec, self.pod_ip, self.env), now)
            if live.failing:
                self._restart_for_probe("liveness", live.last_message)
                return
        ready = self.probes.get("readiness")
        if ready is None:
            self.ready = True
        elif ready.due(now):
            ready.record(*run_probe(ready.probe, self.spec, self.pod_ip, self.env), now)
            if ready.passing:
                self.ready = True
            elif ready.failing or not ready.ever_succeeded:
                self.ready = False

    def wants_restart(self) -> bool:
        return (not self.done and "terminated" in self.state
                and time.monotonic() >= self.backoff_until)

    def begin_restart(self) -> None:
        """Move the terminated state to lastState before the next start."""
        self.last_state = {"terminated": self.state["terminated"]}
        self.restart_count += 1

    def status(self) -> dict:
        state = self.state
        if "terminated" in state and not self.done and time.monotonic() < self.backoff_until:
            wait = self.backoff_until - time.monotonic()
            state = {"waiting": {"reason": "CrashLoopBackOff", "message":
                                 f"back-off {self.backoff_s / 2:.0f}s restarting failed "
                                 f"container={self.name} ({wait:.0f}s left)"}}
            last = {"terminated": self.state["terminated"]}
        else:
            last = self.last_state
        out = {"name": self.name, "image": self.spec.get("image", ""), "imageID": "",
               "ready": self.ready, "started": self.started and "running" in self.state,
               "restartCount": self.restart_count, "state": state, "lastState": last}
        if self.proc is not None:
            out["containerID"] = f"local://{self.proc.pid}"
        return out
