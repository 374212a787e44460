"""Helpers to run real ``shardline-runtime serve`` processes (loopback only) in tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
# A context longer than the KV pool, so "fits the context but not the pool" (S1) is testable.
CONTEXT = 4096
POOL = 2048
# A context (128) smaller than the KV pool (1024): the context is the limit.
SMALL_CONTEXT = 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A running server: ``url``, ``proc``, ``log`` path, and its command-line ``args``."""

    url: str
    proc: subprocess.Popen
    log: Path
    args: list[str] = field(default_factory=list)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=kw.pop("timeout", 60), **kw)

    def post(self, path: str, json=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=json, timeout=kw.pop("timeout", 120), **kw)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def server_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "runtime"), env.get("PYTHONPATH", "")])
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update(extra or {})
    return env


def start_server(model_path, log_dir: Path, *extra: str, host: str = "127.0.0.1", port: int | None = None,
                 wait_ready: bool = True, timeout: float = 600, env: dict | None = None) -> ServerProcess:
    """Start ``python -m shardline_runtime serve`` and wait for ``/ready`` (unless told not to)."""
    port = port or free_port()
    args = ["--model-path", str(model_path), "--host", host, "--port", str(port), *extra]
    log = log_dir / f"server-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "shardline_runtime", "serve", *args], cwd=REPO,
                                env=server_env(env), stdout=out, stderr=subprocess.STDOUT)
    server = ServerProcess(f"http://{host}:{port}", proc, log, args)
    if wait_ready:
        wait_until_ready(server, timeout)
    return server


def wait_until_ready(server: ServerProcess, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"server not ready after {timeout}s:\n{server.log_tail()}")


def server_stats(server: ServerProcess) -> dict:
    return server.get("/get_server_info").json()


def wait_for_baseline(server: ServerProcess, timeout: float = 20) -> dict:
    """Wait until no request runs or waits and no KV slot is held by a request."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_stats(server)
        if info["num_running_reqs"] == 0 and info["num_queued_reqs"] == 0 and info["kv_used_tokens"] == 0:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"server did not return to baseline: {info}")
        time.sleep(0.1)
