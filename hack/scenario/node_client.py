"""Reach pods and Services of the real node (``LocalCluster(real_node=True)``) from the host.

Pod IPs live on the node's CNI bridge and Service ClusterIPs are kube-proxy's iptables rules,
both inside the node's own network namespace, so a client runs there:
``ip netns exec``-style through :meth:`RealNode.exec_argv`, with this checkout's Python and
packages (the real ``openai`` client among them)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hack.localcluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]

CHAT = """import sys
from hack.scenario.serving import chat
print(chat(sys.argv[1], sys.argv[2], sys.argv[3], max_tokens=int(sys.argv[4]),
           api_key=(sys.argv[5:] or [None])[0]))"""


def python_in_node(cluster: LocalCluster, code: str, *args: str, timeout: float = 180) -> str:
    """Run ``python3 -c code args...`` in the node's network namespace, where pod IPs and
    Service ClusterIPs route; return its stdout.

    Raises AssertionError with the tail of stderr if the command exits non-zero, and
    subprocess.TimeoutExpired after ``timeout`` seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "operator"), str(ROOT / "runtime")])}
    proc = subprocess.run(cluster.node.exec_argv([sys.executable, "-c", code, *args]),
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"in the node's namespace: {proc.stderr[-3000:]}"
    return proc.stdout


def chat_in_node(cluster: LocalCluster, ip: str, model: str, prompt: str,
                 api_key: str | None = None, max_tokens: int = 12) -> str:
    """Greedy chat completion (the OpenAI client, temperature 0) from ``http://ip:8000/v1``,
    sent from the node's network namespace (``ip``: a pod IP or a Service's ClusterIP);
    returns the text without its trailing newline."""
    out = python_in_node(cluster, CHAT, ip, model, prompt, str(max_tokens),
                         *([api_key] if api_key else []))
    return out[:-1] if out.endswith("\n") else out
