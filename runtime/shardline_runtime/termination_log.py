"""The termination log: the first fatal error line of a runtime container.

Kubernetes (or the local node agent) shows this file's content as the container's
``state.terminated.message``. The path is env ``SHARDLINE_TERMINATION_LOG``, else
``/dev/termination-log`` when its directory is writable. Every layer that can die (the CLI,
``launch.py``, a scheduler process, the scheduler's watchdog) writes here, so this module imports
nothing of the runtime.
"""

from __future__ import annotations

import os

DEFAULT_TERMINATION_LOG = "/dev/termination-log"
_written = False


def termination_log_path(default: str = DEFAULT_TERMINATION_LOG) -> str | None:
    """Path the first fatal error line goes to, or ``None`` when there is nowhere writable.

    The kubelet creates the file ``terminationMessagePath`` names (mode 0666) and bind-mounts it
    into the container, while the directory (``/dev``) stays read-only to a non-root user: a
    writable file is enough, a writable directory only matters where no file exists yet.
    """
    path = os.environ.get("SHARDLINE_TERMINATION_LOG")
    if path:
        return path
    if os.path.isfile(default) and os.access(default, os.W_OK):
        return default
    directory = os.path.dirname(default)
    if os.path.isdir(directory) and os.access(directory, os.W_OK):
        return default
    return None


def write_termination_log(message: str) -> None:
    """Write ``message``'s first line to the termination log; never raises.

    Only the first fatal error counts: nothing is written when this process already wrote one
    or the file already holds a line (e.g. from a scheduler process of the same pod).
    """
    global _written
    if _written:
        return
    _written = True
    path = termination_log_path()
    if path is None:
        return
    line = (message.strip().splitlines() or ["fatal error"])[0][:4000]
    try:
        if os.path.exists(path) and os.path.getsize(path) > 0 and path != DEFAULT_TERMINATION_LOG:
            return
        with open(path, "w", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError:
        pass
