"""Process bookkeeping for the local cluster: free loopback ports, detached starts with
per-process log files, and stopping strictly by saved PID (never by name)."""
from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None,
          pass_fds: tuple[int, ...] = (), cwd: Path | None = None) -> subprocess.Popen:
    """Start ``argv`` in its own session (so it outlives a CLI parent and can be stopped as a
    process group), stdout+stderr appended to ``log_dir/<name>.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"{name}.log", "ab")
    try:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                start_new_session=True, pass_fds=pass_fds)
    finally:
        log.close()


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the process group led by ``pid`` (each process was started as a session
    leader), wait up to ``grace_s``, then SIGKILL it. Missing processes are fine."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            _reap(pid)
            if not alive(pid):
                _reap(pid)  # it may have turned zombie just after the first try
                return
            time.sleep(0.1)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
