"""The node agent's /etc/hosts block (on a temp file): only its own block changes, blocks of
dead agents are dropped, and StatefulSet pods get their two DNS names."""
from __future__ import annotations

import re

from hack.node_agent.hosts import HostsFile, pod_dns_names


def test_blocks_are_independent_and_dead_ones_removed(tmp_path):
    hosts = tmp_path / "hosts"
    dead = ("# BEGIN shardline-node-agent old-1 pid=999999999\n127.77.9.2 x.y.z.svc\n"
            "# END shardline-node-agent old-1\n")
    hosts.write_text("127.0.0.1 localhost\n" + dead)
    a = HostsFile("a-1", hosts)
    b = HostsFile("b-2", hosts)
    text = hosts.read_text()
    assert "old-1" not in text and text.startswith("127.0.0.1 localhost\n")
    a.set("uid1", "127.77.1.2", ["p-0.s.ns.svc", "p-0.s.ns.svc.cluster.local"])
    b.set("uid9", "127.77.2.2", ["q-0.s.ns.svc"])
    a.set("uid2", "127.77.1.3", ["p-1.s.ns.svc"])
    text = hosts.read_text()
    assert "127.77.1.2 p-0.s.ns.svc p-0.s.ns.svc.cluster.local" in text
    assert "127.77.2.2 q-0.s.ns.svc" in text
    a.remove("uid1")
    assert "p-0.s.ns.svc" not in hosts.read_text() and "p-1.s.ns.svc" in hosts.read_text()
    a.clear()
    text = hosts.read_text()
    assert "a-1" not in text and "q-0.s.ns.svc" in text
    assert len(re.findall("BEGIN", text)) == 1


def test_pod_dns_names():
    pod = {"metadata": {"name": "d-g0-0", "namespace": "ns"},
           "spec": {"hostname": "d-g0-0", "subdomain": "d-g0-ranks"}}
    assert pod_dns_names(pod) == ["d-g0-0.d-g0-ranks.ns.svc",
                                  "d-g0-0.d-g0-ranks.ns.svc.cluster.local"]
    assert pod_dns_names({"metadata": {"name": "p"}, "spec": {}}) == []
