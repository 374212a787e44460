"""One time line of an in-place rollout from every source that stamps it, for ``bench/rollout.py
--verbose``: the operator's log (its passes at ``logLevel: debug``, each routing step and update
request), the leaders' scheduler logs (the update's own lines), the statuses a watch saw and the
group events ``rollout_timeline.Timeline`` sampled, each as seconds since the patch.

Log lines are read from the files the node agent writes for each container
(``<cluster state>/pods/<namespace>_<pod>_<uid prefix>/<container>.log``); both the operator and the runtime's
scheduler start a line with ``logging``'s ``asctime`` (local time, milliseconds).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

STAMP = re.compile(r"^(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}),(\d{3}) (.*)$")
# Lines worth a place on the time line (the rest is request traffic and Kopf's own chatter).
OPERATOR_LINES = re.compile(r"shardline_operator|reconciled \(")
RUNTIME_LINES = re.compile(r"UpdateWeights|weight update|staging|Staging", re.IGNORECASE)


def stamped_lines(path: Path, since: float, until: float, keep: re.Pattern) -> list[tuple[float, str]]:
    """``(unix seconds, text)`` of the lines of ``path`` stamped within ``[since, until]`` that
    ``keep`` matches (unreadable file: none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        match = STAMP.match(line)
        if match is None or not keep.search(match.group(3)):
            continue
        at = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + int(match.group(2)) / 1000
        if since <= at <= until:
            out.append((at, match.group(3)))
    return out


def rollout_log(state_dir: Path, namespace: str, name: str, since: float, until: float,
                operator_namespace: str = "shardline-system") -> list[tuple[float, str]]:
    """The operator's and ``name``'s leaders' log lines within ``[since, until]`` (unix seconds),
    in time order, each text prefixed with its source (``operator`` or the pod's name)."""
    pods = state_dir / "pods"
    lines = [(at, f"[operator] {text}") for log in sorted(pods.glob(f"{operator_namespace}_*/*.log"))
             for at, text in stamped_lines(log, since, until, OPERATOR_LINES)]
    # the node agent names a pod's directory <namespace>_<pod>_<uid prefix>
    for log in sorted(pods.glob(f"{namespace}_{name}-g*-0_*/*.log")):
        pod = log.parent.name.split("_")[1]
        lines += [(at, f"[{pod}] {text}") for at, text in stamped_lines(log, since, until, RUNTIME_LINES)]
    return sorted(lines)
