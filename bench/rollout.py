"""In-place rollout in the local cluster: where its time goes, latency after each group, and
(``--restart``) the same deployment rolled with strategy Restart.

``--groups`` groups (TP=1, one pod each; default 3) serve a tiny model, or with ``--params-200m``
a ~200M-parameter float32 llama (``hack/scenario/large_model.py``: written once into
~/.cache/shardline and reused). Client traffic (``hack/scenario/traffic.py``: a fixed rate,
round-robin over the Ready, non-terminating leaders, a fresh connection per request) runs
``--warmup`` seconds before the patch (the pre-rollout latency), through the rollout and
``--settle`` seconds after it (``--client service``: only to the leaders the deployment's Service
selects, i.e. routable ones, as kube-proxy does). The rollout is timed from the patch (one REST
request) to the first status the watch sees Ready with every group on the new revision.

Prints:

- the rollout time against the sum of the groups' own update times (``load_seconds +
  recapture_seconds`` from each leader's ``/get_server_info``), and per group where the rest
  went (``hack/scenario/rollout_timeline.py``): the runtime's work around the update, the wait
  for the pod to be Ready again, and the gap before the next group's update began;
- per group the pre-rollout p95 latency and the time from "available again" until its p95 is
  back within 1.5x of it (a 5-s sliding window), and the worst latency after it was available;
- with ``--verbose``, one time line from the patch (``hack/scenario/rollout_log.py``): every
  status seen, each group's sampled steps, and the operator's (installed at log level debug:
  each pass's phases, each routing step and update request with its duration) and the leaders'
  log lines about the update.

With ``--staging`` it measures instead an S3 rollout with and without the staging step (issue 25:
``bench/rollout_staging.py``), in one run.

    python bench/rollout.py                      # starts a local cluster (binaries cached)
    python bench/rollout.py --staging            # S3 rollout with vs without staging
    SHARDLINE_CLUSTER_DIR=/tmp/kube python bench/rollout.py --params-200m --restart
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hack.localcluster import LocalCluster  # noqa: E402
from hack.scenario.large_model import large_revisions  # noqa: E402
from hack.scenario.models import write_revisions  # noqa: E402
from hack.scenario.operator_install import install_operator  # noqa: E402
from hack.scenario.rollout_fleet import apply, leader_server_infos, patch, two_group_doc, wait_ready  # noqa: E402
from hack.scenario.rollout_log import rollout_log  # noqa: E402
from hack.scenario.rollout_timeline import (  # noqa: E402
    RECOVERED_FACTOR,
    Timeline,
    beside_loads,
    breakdown,
    p95,
    recovery,
)
from hack.scenario.traffic import Traffic  # noqa: E402


def in_place(cluster, watch, ns: str, revs: dict, model: str, args) -> None:
    mark = watch.mark()
    timeline = Timeline(cluster.client(), ns, "bench", args.groups, "rev-b").start()
    with Traffic(cluster.client(), ns, "bench", model, args.rate,
                 routable_only=args.client == "service") as traffic:
        time.sleep(args.warmup)
        before = queues(cluster, ns)
        # One API request (no kubectl process to start): the rollout is timed from its sending.
        client, path = cluster.client(), f"/apis/shardline.dev/v1alpha1/namespaces/{ns}/inferencedeployments/bench"
        patched, patched_wall = time.monotonic(), time.time()
        client.merge_patch(path, {"spec": {"model": {"path": str(revs["rev-b"]), "revision": "rev-b"}}})
        done = wait_ready(watch, "rev-b", mark, 900).at  # when the watch saw that status
        time.sleep(args.settle)
        end = time.monotonic()
        after = queues(cluster, ns)
    # Requests still in flight when the client stopped sending (a stalled leader's) are recorded
    # only when they end: wait for them (up to the client's timeout), so none is left out.
    waited_until = time.monotonic() + traffic.timeout + 5
    while len(traffic.records) < traffic.sent and time.monotonic() < waited_until:
        time.sleep(0.5)
    timeline.stop()
    groups = list(timeline.by_group.values())
    rows = breakdown(groups, patched, done)
    total, updates = done - patched, sum(g.update_seconds for g in groups)
    print(f"InPlace: rollout {total:.1f} s; sum of updates {updates:.1f} s; overhead "
          f"{total - updates:.1f} s ({(total - updates) / args.groups:.1f} s per group; target <= 1.0); "
          f"ratio {total / updates:.2f}x; {traffic.sent} requests, {len(traffic.failures)} failed, "
          f"{traffic.sent - len(traffic.records)} unanswered after the client's timeout")
    print(f"{'group':>5}{'gap before':>12}{'update':>8}{'runtime extra':>15}{'ready lag':>11}")
    for row in rows:
        print(f"{row['group']:>5}{row['gap_before']:>12.2f}{row['update']:>8.2f}"
              f"{row['runtime_extra']:>15.2f}{row['ready_lag']:>11.2f}")
    if rows:
        print(f"last group available -> status Ready: {rows[-1]['tail']:.2f} s")
    print(f"{'group':>5}{'p95 before':>12}{'recovered after (s)':>21}{'worst after':>13}"
          f"   (within {RECOVERED_FACTOR}x of p95 before; target <= 10 s)")
    for g in sorted(groups, key=lambda g: g.index):
        base, recovered, worst = recovery(traffic.records, g, patched, end)
        shown = f"{recovered:.2f}" if math.isfinite(recovered) else "never"
        print(f"{g.index:>5}{base:>12.2f}{shown:>21}{worst:>13.2f}")
    beside, alone = beside_loads(traffic.records, groups, patched, end)
    print(f"after the patch, requests to groups not updating: p95 {p95(beside):.2f} s while another "
          f"group loads ({len(beside)} requests), {p95(alone):.2f} s while none does ({len(alone)})")
    # A fleet over its capacity shows a queue that grows through the warmup: its latencies
    # then measure the queue, not the rollout.
    half = patched - args.warmup / 2
    early = [t for sent, _, t, _ in traffic.records if half - args.warmup / 2 <= sent < half]
    late = [t for sent, _, t, _ in traffic.records if half <= sent < patched]
    print(f"warmup p95: first half {p95(early):.2f} s, second half {p95(late):.2f} s; leaders' "
          f"running/queued requests at the patch {before}, at the end {after}")
    for failure in traffic.failures[:5]:
        print(f"  failed: {failure}")
    if args.verbose:
        print_time_line(cluster, watch.history[mark:], groups, ns, patched, patched_wall, done)


def queues(cluster, ns: str) -> str:
    """Each leader's ``running/queued`` requests (``/get_server_info``), as one string."""
    try:
        infos = leader_server_infos(cluster.client(), ns, "bench")
    except Exception as exc:  # noqa: BLE001 (a report line, not a reason to lose the run)
        return f"(not read: {exc.__class__.__name__})"
    return ", ".join(f"{pod.split('-')[-2]} {info.get('num_running_reqs')}/{info.get('num_queued_reqs')}"
                     for pod, info in sorted(infos.items()))


def print_time_line(cluster, statuses, groups, ns: str, patched: float, patched_wall: float,
                    done: float) -> None:
    """Every status seen, each group's sampled steps and the operator's and leaders' log lines
    (``hack/scenario/rollout_log.py``), as seconds since the patch."""
    lines = []
    for snap in statuses:
        progressing = snap.conditions.get("Progressing", ("", "", ""))[2]
        lines.append((snap.at - patched, f"[status] {snap.line()} {progressing}"))
    for g in groups:
        for what in ("loading_at", "serving_at", "available_at"):
            at = getattr(g, what)
            if at is not None:
                lines.append((at - patched, f"[sampled] group {g.index} {what[:-3]}"))
    lines += [(at - patched_wall, text) for at, text in
              rollout_log(cluster.state_dir, ns, "bench", patched_wall - 1, patched_wall + done - patched + 1)]
    for at, text in sorted(lines):
        print(f"  {at:7.2f} {text[:220]}")


def restart(cluster, watch, ns: str, revs: dict, model: str, rate: float) -> None:
    mark = watch.mark()
    spec = {"model": {"path": str(revs["rev-a"]), "revision": "rev-a"}, "weightUpdate": {"strategy": "Restart"}}
    with Traffic(cluster.client(), ns, "bench", model, rate) as traffic:
        started = time.monotonic()
        patch(cluster, ns, "bench", spec)
        wait_ready(watch, "rev-a", mark, 900)
        seconds = time.monotonic() - started
    print(f"Restart: rollout {seconds:.1f} s; {traffic.sent} requests, {len(traffic.failures)} failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params-200m", action="store_true", help="a ~200M-parameter float32 model")
    parser.add_argument("--groups", type=int, default=3, help="groups (replicas), TP=1 each")
    parser.add_argument("--rate", type=float, default=4.0, help="client requests per second")
    parser.add_argument("--client", choices=("ready", "service"), default="ready",
                        help="in-place rollout traffic: to every Ready leader, or (service) only to "
                             "those the deployment's Service selects (routable), as kube-proxy does")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds of traffic before the patch")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds of traffic after the rollout")
    parser.add_argument("--verbose", action="store_true",
                        help="print one time line from the patch: statuses, sampled group steps, "
                             "operator (at log level debug) and leader log lines")
    parser.add_argument("--restart", action="store_true", help="then roll back with strategy Restart")
    parser.add_argument("--staging", action="store_true",
                        help="an S3 rollout with and without staging (bench/rollout_staging.py)")
    parser.add_argument("--staging-last", action="store_true",
                        help="with --staging: run the rollout without staging first")
    args = parser.parse_args()
    existing = os.environ.get("SHARDLINE_CLUSTER_DIR")
    cluster = LocalCluster.load(Path(existing)) if existing else LocalCluster(state_dir=Path(tempfile.mkdtemp(prefix="kube-")))
    if not existing:
        cluster.start()
    try:
        revs = large_revisions() if args.params_200m else write_revisions()
        install_operator(cluster, values={"logLevel": "debug"} if args.verbose else None)
        if args.staging:
            from bench.rollout_staging import compare

            compare(cluster, revs, args.rate, staging_first=not args.staging_last)
            return
        ns = f"bench-{uuid.uuid4().hex[:6]}"
        doc = two_group_doc(ns, "bench", str(revs["rev-a"]), "rev-a", startup_timeout=900, replicas=args.groups)
        watch = apply(cluster, doc)
        wait_ready(watch, "rev-a", 0, 900)
        model = doc["spec"]["model"]["name"]
        size = "~200M params float32" if args.params_200m else "tiny"
        print(f"model: {size}; {args.groups} groups (TP=1); client {args.rate:g} req/s")
        in_place(cluster, watch, ns, revs, model, args)
        if args.restart:
            restart(cluster, watch, ns, revs, model, args.rate)
        watch.stop()
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    finally:
        if not existing:
            cluster.stop()


if __name__ == "__main__":
    main()
