"""Container probes (httpGet, tcpSocket, exec) with kubelet's thresholds.

Timing: liveness and startup probes run at their ``periodSeconds`` exactly (their thresholds
are a restart budget: a startup probe kills the container only after
``initialDelaySeconds + failureThreshold * periodSeconds`` without success). Readiness runs at
``min(periodSeconds, READINESS_PERIOD_CAP)`` so Ready shows up quickly in tests; a
readiness result only changes whether the pod receives traffic.
"""
from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass, field

import httpx

READINESS_PERIOD_CAP = 1.0


def _port(container: dict, port) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"probe port {port!r} is not a named port of container "
                     f"{container.get('name')!r}")


def run_probe(probe: dict, container: dict, pod_ip: str, env: dict[str, str]) -> tuple[bool, str]:
    """Run one probe; returns ``(success, message)``. Never raises."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            h = probe["httpGet"]
            host = h.get("host") or pod_ip
            scheme = h.get("scheme", "HTTP").lower()
            path = h.get("path", "/")
            url = f"{scheme}://{host}:{_port(container, h['port'])}{path}"
            headers = {x["name"]: x["value"] for x in h.get("httpHeaders", [])}
            r = httpx.get(url, headers=headers, timeout=timeout, verify=False)
            ok = 200 <= r.status_code < 400
            return ok, f"HTTP probe failed with statuscode: {r.status_code}" if not ok else ""
        if "tcpSocket" in probe:
            t = probe["tcpSocket"]
            with socket.create_connection((t.get("host") or pod_ip, _port(container, t["port"])),
                                          timeout=timeout):
                return True, ""
        if "exec" in probe:
            r = subprocess.run(probe["exec"]["command"], env=env, capture_output=True,
                               timeout=timeout, text=True)
            return r.returncode == 0, (r.stdout + r.stderr)[-500:]
        if "grpc" in probe:
            return False, "grpc probes are not supported by the node agent"
    except (httpx.HTTPError, OSError, subprocess.TimeoutExpired, ValueError) as e:
        return False, f"probe error: {e}"
    return False, "probe has no handler"


@dataclass
class ProbeState:
    """One probe's schedule and consecutive-result counters."""

    probe: dict
    kind: str  # "startup" | "liveness" | "readiness"
    started_at: float
    successes: int = 0
    failures: int = 0
    ever_succeeded: bool = False
    last_message: str = ""
    next_at: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.next_at = self.started_at + float(self.probe.get("initialDelaySeconds", 0))

    @property
    def period(self) -> float:
        period = float(self.probe.get("periodSeconds", 10))
        return min(period, READINESS_PERIOD_CAP) if self.kind == "readiness" else period

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, message: str, now: float) -> None:
        self.next_at = now + self.period
        self.last_message = message
        if ok:
            self.successes += 1
            self.failures = 0
            self.ever_succeeded = True
        else:
            self.failures += 1
            self.successes = 0

    @property
    def passing(self) -> bool:
        """Startup: succeeded once. Others: ``successThreshold`` successes in a row."""
        if self.kind == "startup":
            return self.ever_succeeded
        return self.successes >= int(self.probe.get("successThreshold", 1))

    @property
    def failing(self) -> bool:
        """``failureThreshold`` failures in a row (the startup/liveness restart trigger)."""
        return self.failures >= int(self.probe.get("failureThreshold", 3))
