"""Node agent containers without a cluster: probes gate readiness, crashes restart with the
termination message in lastState, and kill() ends the whole process group."""
from __future__ import annotations

import os
import random
import sys
import time

from hack.node_agent.container import Container


def _tick_until(c: Container, cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c.poll()
        c.run_probes()
        if c.wants_restart():
            c.begin_restart()
            c.start(c.argv, c.env, c.pod_ip)
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out; status {c.status()}")


def test_readiness_probe_gates_ready_and_kill_ends_group(tmp_path):
    ip = f"127.78.{random.randint(0, 250)}.{random.randint(2, 250)}"
    spec = {"name": "web", "command": [sys.executable, "-m", "http.server", "8080", "--bind", ip],
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 5}}
    c = Container(spec, tmp_path, "Always", grace_s=5)
    env = {"PATH": os.environ["PATH"], "SHARDLINE_TERMINATION_LOG": str(c.termination_log)}
    c.start(spec["command"], env, ip)
    assert c.status()["ready"] is False
    _tick_until(c, lambda: c.ready)
    st = c.status()
    assert st["ready"] and "running" in st["state"] and st["containerID"].startswith("local://")
    pid = c.proc.pid
    c.kill(grace_s=5)
    assert "terminated" in c.state and c.done
    try:
        os.killpg(pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive


def test_crash_restarts_with_message_and_backoff(tmp_path):
    script = ("import os; open(os.environ['SHARDLINE_TERMINATION_LOG'], 'w')"
              ".write('boom: bad shard'); raise SystemExit(7)")
    spec = {"name": "crash", "command": [sys.executable, "-c", script]}
    c = Container(spec, tmp_path, "Always")
    env = {"PATH": os.environ["PATH"], "SHARDLINE_TERMINATION_LOG": str(c.termination_log)}
    c.start(spec["command"], env, "127.0.0.1")
    _tick_until(c, lambda: c.restart_count >= 2)
    st = c.status()
    term = st["lastState"]["terminated"]
    assert term["exitCode"] == 7 and term["message"] == "boom: bad shard"
    c.kill(grace_s=1)


def test_never_policy_completes(tmp_path):
    spec = {"name": "once", "command": [sys.executable, "-c", "print('hi')"]}
    c = Container(spec, tmp_path, "Never")
    c.start(spec["command"], {"PATH": os.environ["PATH"]}, "127.0.0.1")
    deadline = time.monotonic() + 20
    while not c.done and time.monotonic() < deadline:
        c.poll()
        time.sleep(0.1)
    assert c.done and c.state["terminated"]["exitCode"] == 0
    assert c.state["terminated"]["reason"] == "Completed"
    assert "hi" in c.log_path.read_text()
