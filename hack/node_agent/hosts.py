"""Pod DNS names through a managed block in /etc/hosts.

Each agent owns one block ``# BEGIN shardline-node-agent <cluster-id> pid=<pid>`` ...
``# END ...`` and rewrites only that block, in place (the file may be a bind mount, so it is
never replaced by rename), under an flock shared by all agents. Blocks left by agents that
died are removed at start. glibc's ``files`` backend rereads /etc/hosts on every lookup, so the
runtime processes (Python and gloo's C++ resolver alike) see changes at once.
"""
from __future__ import annotations

import fcntl
import os
import re
import tempfile
import threading
from pathlib import Path

LOCK = Path(tempfile.gettempdir()) / "shardline-hosts.lock"
_BLOCK = re.compile(r"^# BEGIN shardline-node-agent (\S+) pid=(\d+)\n.*?^# END shardline-node-agent \1\n",
                    re.M | re.S)


def pod_dns_names(pod: dict) -> list[str]:
    """StatefulSet-style names of a pod with ``spec.hostname`` and ``spec.subdomain``:
    ``<hostname>.<subdomain>.<ns>.svc`` and the ``.cluster.local`` form; [] otherwise."""
    spec, meta = pod.get("spec", {}), pod.get("metadata", {})
    host, sub = spec.get("hostname"), spec.get("subdomain")
    if not host or not sub:
        return []
    base = f"{host}.{sub}.{meta.get('namespace', 'default')}.svc"
    return [base, f"{base}.cluster.local"]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class HostsFile:
    """The agent's block of /etc/hosts: ``set(key, ip, names)`` / ``remove(key)``."""

    def __init__(self, cluster_id: str, path: Path = Path("/etc/hosts")):
        self.cluster_id = cluster_id
        self.path = path
        self._entries: dict[str, tuple[str, list[str]]] = {}
        self._lock = threading.Lock()
        if not os.access(path, os.W_OK):
            raise PermissionError(
                f"the node agent needs write access to {path} to resolve StatefulSet pod DNS "
                f"names (run it as root, or grant it: sudo setfacl -m u:$USER:rw {path})")
        self._rewrite(clean_dead=True)

    def set(self, key: str, ip: str, names: list[str]) -> None:
        if not names:
            return
        with self._lock:
            self._entries[key] = (ip, names)
            self._rewrite()

    def remove(self, key: str) -> None:
        with self._lock:
            if self._entries.pop(key, None) is not None:
                self._rewrite()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._rewrite(drop_own=True)

    def _block(self) -> str:
        lines = [f"# BEGIN shardline-node-agent {self.cluster_id} pid={os.getpid()}"]
        lines += [f"{ip} {' '.join(names)}" for ip, names in sorted(self._entries.values())]
        lines.append(f"# END shardline-node-agent {self.cluster_id}")
        return "\n".join(lines) + "\n"

    def _rewrite(self, clean_dead: bool = False, drop_own: bool = False) -> None:
        with open(LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            with open(self.path, "r+") as f:
                text = f.read()

                def keep(m: re.Match) -> str:
                    if m.group(1) == self.cluster_id:
                        return ""
                    if clean_dead and not _pid_alive(int(m.group(2))):
                        return ""
                    return m.group(0)

                text = _BLOCK.sub(keep, text)
                if text and not text.endswith("\n"):
                    text += "\n"
                if not drop_own:
                    text += self._block()
                f.seek(0)
                f.write(text)
                f.truncate()
