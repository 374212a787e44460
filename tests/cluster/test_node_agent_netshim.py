"""The node agent's bind shim: two "pods" can both listen on the wildcard address at one port,
each ending up on its own pod IP (what torch's TCPStore does with port 29500)."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

import pytest

from hack.node_agent.netshim import build_shim

LISTEN = """
import socket, sys, time
s = socket.socket(socket.AF_INET6)
s.bind(("::", int(sys.argv[1])))
s.listen()
t = socket.socket()
t.bind(("0.0.0.0", int(sys.argv[1]) + 1))
t.listen()
print(s.getsockname()[0], t.getsockname()[0], flush=True)
time.sleep(3)
"""


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler for the bind shim")
def test_wildcard_binds_go_to_each_pod_ip(tmp_path):
    shim, message = build_shim(tmp_path)
    assert shim is not None, message
    port = random.randint(30000, 40000)
    subnet = random.randint(0, 250)
    ips = [f"127.78.{subnet}.2", f"127.78.{subnet}.3"]
    procs = [subprocess.Popen([sys.executable, "-c", LISTEN, str(port)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=dict(os.environ, LD_PRELOAD=str(shim), SHARDLINE_POD_IP=ip))
             for ip in ips]
    outputs = [p.communicate(timeout=30) for p in procs]
    for ip, proc, (out, err) in zip(ips, procs, outputs):
        assert proc.returncode == 0, err
        assert out.split() == [f"::ffff:{ip}", ip]
