"""Rollout time with and without staging (issue 25), for ``bench/rollout.py --staging``.

The same S3 rollout (``s3://models/tiny/rev-a`` -> ``rev-b``, a real versitygw, two groups of
TP=1, client traffic throughout) twice, each on a fresh deployment and a fresh cache:

- with staging: the cache is a ``hostPath``, so the operator first runs a staging Job per node
  (download + verify in parallel), then updates the groups, whose leaders find the revision in
  the cache;
- without staging: the default per-pod ``emptyDir`` cache, so each leader downloads and
  verifies the revision itself before its group pauses, one group after the other.

For each: the rollout's wall time (patch -> Ready on rev-b), the staging step's time
(``status.staging`` startedAt -> finishedAt), and the sum of the groups' update times alone
(each leader's ``last_update.load_seconds + recapture_seconds``: the paused part), plus failed
requests.
"""
from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

from hack.s3server import S3Server
from hack.scenario.rollout_fleet import apply, leader_server_infos, patch, wait_ready
from hack.scenario.s3_models import BUCKET, s3_deployment, upload_revisions
from hack.scenario.traffic import Traffic

TIMEOUT = 900


def _seconds(stamp_from: str | None, stamp_to: str | None) -> float | None:
    from datetime import datetime

    if not stamp_from or not stamp_to:
        return None
    parse = lambda s: datetime.fromisoformat(s.replace("Z", "+00:00"))  # noqa: E731
    return (parse(stamp_to) - parse(stamp_from)).total_seconds()


def _update_seconds(client, ns: str) -> float:
    total = 0.0
    for info in leader_server_infos(client, ns, "bench").values():
        last = (info.get("weights") or {}).get("last_update") or {}
        total += float(last.get("load_seconds") or 0) + float(last.get("recapture_seconds") or 0)
    return total


def one_rollout(cluster, s3, cache_volume: dict | None, rate: float) -> dict:
    """Deploy on rev-a, roll to rev-b under traffic; the figures (see the module docstring)."""
    ns = f"bench-st-{uuid.uuid4().hex[:6]}"
    doc = s3_deployment(cluster, s3, ns, "bench", "rev-a", cache_volume)
    watch = apply(cluster, doc)
    client = cluster.client()
    try:
        wait_ready(watch, "rev-a", 0, TIMEOUT)
        mark = watch.mark()
        with Traffic(client, ns, "bench", "tiny-llama", rate) as traffic:
            started = time.monotonic()
            patch(cluster, ns, "bench", {"model": {"uri": f"s3://{BUCKET}/tiny/rev-b", "revision": "rev-b"}})
            wait_ready(watch, "rev-b", mark, TIMEOUT)
            seconds = time.monotonic() - started
        timeline, last = [], None
        for snap in watch.history[mark:]:
            if snap.phase != last:
                timeline.append(f"{snap.phase} {max(snap.at - started, 0.0):.1f}s")
                last = snap.phase
        status = client.get(f"/apis/shardline.dev/v1alpha1/namespaces/{ns}/inferencedeployments/bench")["status"]
        staging = status.get("staging") or {}
        return {
            "seconds": seconds,
            "staging": _seconds(staging.get("startedAt"), staging.get("finishedAt")),
            "updates": _update_seconds(client, ns),
            "sent": traffic.sent,
            "failed": len(traffic.failures),
            "phases": timeline,
        }
    finally:
        watch.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def compare(cluster, revisions: dict[str, Path], rate: float, staging_first: bool = True) -> None:
    """Run both rollouts (``staging_first``: in that order) and print the table, with each
    rollout's phases and when they began (seconds after the patch)."""
    with (tempfile.TemporaryDirectory(prefix="bench-s3-") as root,
          tempfile.TemporaryDirectory(prefix="bench-model-cache-") as cache,
          S3Server(Path(root)) as s3):
        upload_revisions(s3, revisions, {"rev-a": "rev-a", "rev-b": "rev-b"})
        hostpath = {"hostPath": {"path": cache, "type": "DirectoryOrCreate"}}
        order = [("with staging", hostpath), ("without staging", None)]
        rows = [(name, one_rollout(cluster, s3, volume, rate))
                for name, volume in (order if staging_first else order[::-1])]
    print(f"S3 rollout rev-a -> rev-b; 2 groups (TP=1); client {rate:g} req/s")
    print(f"{'':<17}{'rollout s':>10}{'staging s':>10}{'updates s':>10}{'requests':>9}{'failed':>7}")
    for name, r in rows:
        staging = f"{r['staging']:.1f}" if r["staging"] is not None else "-"
        print(f"{name:<17}{r['seconds']:>10.1f}{staging:>10}{r['updates']:>10.1f}{r['sent']:>9}{r['failed']:>7}")
        print(f"  phases (s after the patch): {' -> '.join(r['phases'])}")
