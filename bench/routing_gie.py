"""Routing benchmark in the local cluster: round robin vs the GIE endpoint picker vs SMG, on the
same two runtime leaders and the same request trace as ``bench/routing.py``.

Starts the local control plane with its node agent (``hack/localcluster``), two runtime leader
pods of one tiny llama checkpoint (CPU, ``--max-total-tokens 65536`` each, as
``bench/routing.py``'s servers) and the chart's InferencePool over them with the real EPP
(v1.5.0, built from its Go module; ``hack/gie``), driven over ext-proc by the test client
(``hack/gie/ext_proc.py``: it asks the EPP for an endpoint, sends the request there and reports
the response back, as Envoy would). Routes, each after a prefix-cache flush:

- the client's own round robin over the leaders' pod IPs (what kube-proxy does);
- the EPP (upstream's default profile: queue 2, KV-cache utilisation 2, prefix cache 3);
- ``smg --policy cache_aware`` over the same pod URLs, when ``smg`` is installed.

TTFT includes the EPP's pick (one ext-proc round trip before the request is sent).

    python bench/routing_gie.py            # cold: builds the cluster binaries and the EPP once
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "operator"))

from routing import MODEL, add_trace_args, print_table, run_route  # noqa: E402  (bench/routing.py)
from serving_server import ServerProcess  # noqa: E402
from smg_gateway import prefix_trace, replay, smg_binary, start_smg  # noqa: E402

from hack.gie.ext_proc import EppClient, epp_router  # noqa: E402
from hack.gie.pool import LeaderPool  # noqa: E402
from hack.localcluster import LocalCluster  # noqa: E402


def via_epp(target: str, args):
    def send(trace):
        async def run():
            client = EppClient(target)
            try:
                return await replay(epp_router(client), MODEL, trace, args.concurrency, args.max_tokens)
            finally:
                await client.close()

        return asyncio.run(run())

    return send


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_args(ap)
    args = ap.parse_args(argv)
    from shardline_runtime.tiny_checkpoint import make_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="shardline-routing-gie-"))
    make_tiny_checkpoint(work / "ckpt", arch="llama", seed=0, max_position_embeddings=4096)
    cluster = LocalCluster(state_dir=work / "kube")
    cluster.start()
    rows = []
    try:
        with LeaderPool(cluster, work / "ckpt", work, extra_args=["--max-total-tokens", "65536"]) as pool:
            urls = [f"http://{e}" for e in pool.endpoints.values()]
            servers = [ServerProcess(u, None, work / "unused.log") for u in urls]  # type: ignore[arg-type]
            asyncio.run(replay(urls, MODEL, prefix_trace(4, 2, args.seed + 1000), args.concurrency))  # warm-up
            rows.append(run_route("client round robin (no gateway)", urls, servers, args))
            assert pool.epp is not None
            rows.append(run_route("GIE EPP v1.5.0 (default profile)", via_epp(pool.epp.target, args), servers, args))
            if smg_binary() is not None:
                gateway = start_smg(urls, "cache_aware", work)
                try:
                    rows.append(run_route("smg --policy cache_aware", [gateway.url], servers, args))
                finally:
                    gateway.stop()
    finally:
        cluster.stop()
    print_table(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
