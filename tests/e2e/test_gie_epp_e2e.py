"""Issue 29, item 2, in the local cluster: the real endpoint picker of the Gateway API Inference
Extension (the EPP binary, v1.5.0, built from its Go module) in front of two runtime leaders,
through the InferencePool the chart renders, driven over its ext-proc gRPC by a test client
that does what Envoy does (``hack/gie/ext_proc.py``).

- the EPP scrapes the runtime's model-server-protocol gauges (its per-pod queue gauge follows a
  leader's waiting requests);
- it picks the less-loaded leader while the other one has a queue;
- it keeps each shared prefix on one leader (prefix-cache affinity);
- a leader labelled ``shardline.dev/routable: "false"`` (what the operator does before a group's
  in-place update) leaves the pool and is never picked until it is labelled back;
- SMG (``smg`` from PyPI) discovering the leaders by the same labels in the same cluster
  (``--service-discovery --selector ...``) drops such a leader and takes it back.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx
import pytest

from hack.gie.ext_proc import EppClient
from hack.gie.pool import MODEL, LeaderPool
from hack.scenario.models import write_revisions
from shardline_operator.render.services import routable_leader_labels
from tests.kube_fixtures import agent_nodes_only

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from smg_gateway import prefix_trace, smg_binary, start_smg_discovery  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.slow]

# Two running requests per leader, so a burst leaves a queue (queue-scorer's signal).
LEADER_ARGS = ["--max-running-requests", "2", "--max-total-tokens", "16384"]


@pytest.fixture(scope="module")
def gie_pool(kube_cluster, tmp_path_factory):
    model = write_revisions()["rev-a"]
    with agent_nodes_only(kube_cluster), LeaderPool(kube_cluster, model, tmp_path_factory.mktemp("epp"),
                                                    extra_args=LEADER_ARGS) as p:
        yield p


@pytest.fixture
def pool(gie_pool):
    return gie_pool


def picks(pool: LeaderPool, bodies: list[dict]) -> list[str]:
    """The endpoint the EPP picks for each body, one at a time; each request is then sent there
    and its response reported back, as Envoy would."""

    async def run() -> list[str]:
        client = EppClient(pool.epp.target)
        out = []
        try:
            async with httpx.AsyncClient(timeout=120) as http:
                for body in bodies:
                    pick = await client.pick("/v1/chat/completions", body)
                    resp = await http.post(f"http://{pick.endpoint}/v1/chat/completions", json=body)
                    await pick.finish(resp.status_code, resp.content, "application/json")
                    out.append(pick.endpoint)
        finally:
            await client.close()
        return out

    return asyncio.run(run())


def chat_body(messages: list[dict], max_tokens: int = 2) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def fresh_bodies(n: int, seed: int) -> list[dict]:
    """``n`` requests with distinct prefixes (no affinity anywhere)."""
    return [chat_body(r.messages) for r in prefix_trace(n, 1, seed=seed, prefix_words=40)]


def test_the_pool_holds_both_leaders_with_fresh_metrics(pool):
    # inference_pool_ready_pods counts pods whose /metrics the EPP scraped within 2 s.
    assert pool.pool_size() == 2


def test_every_pick_is_a_leader_endpoint(pool):
    assert set(picks(pool, fresh_bodies(6, seed=1))) <= set(pool.endpoints.values())


def test_each_shared_prefix_stays_on_one_leader(pool):
    trace = sorted(prefix_trace(4, 4, seed=2, prefix_words=160), key=lambda r: r.prefix)
    chosen = picks(pool, [chat_body(r.messages) for r in trace])
    per_prefix: dict[int, set[str]] = {}
    for req, endpoint in zip(trace, chosen):
        per_prefix.setdefault(req.prefix, set()).add(endpoint)
    assert [len(v) for v in per_prefix.values()] == [1, 1, 1, 1], per_prefix


def _queue_sizes(pool: LeaderPool) -> dict[str, float]:
    return pool.epp.metric("inference_pool_per_pod_queue_size")


def test_picks_the_other_leader_while_one_has_a_queue(pool):
    busy_name, busy = sorted(pool.endpoints.items())[0]
    # 6 requests, 2 running at a time: a queue of 4 for the first 128 decode steps.
    long = [chat_body([{"role": "user", "content": f"load {i}"}], max_tokens=128) for i in range(6)]

    async def load() -> None:
        async with httpx.AsyncClient(timeout=300) as http:
            await asyncio.gather(*(http.post(f"http://{busy}/v1/chat/completions", json=b) for b in long))

    async def run() -> tuple[list[str], dict]:
        task = asyncio.create_task(load())
        deadline = time.monotonic() + 30
        while not any(v > 0 and busy_name in k for k, v in _queue_sizes(pool).items()):
            assert time.monotonic() < deadline, f"the EPP never saw {busy_name}'s queue: {_queue_sizes(pool)}"
            await asyncio.sleep(0.05)
        seen = _queue_sizes(pool)
        chosen = await asyncio.to_thread(picks, pool, fresh_bodies(4, seed=3))
        await task
        return chosen, seen

    chosen, seen = asyncio.run(run())
    assert busy not in chosen, (chosen, seen)


def _prefix_living_on(pool: LeaderPool, endpoint: str, seed: int) -> list[dict]:
    """Two requests sharing a system prompt, the first of which the EPP put on ``endpoint``: it
    is sent while the other leaders are labelled out of routing, so the EPP has nowhere else to
    put it (a fresh prompt ties on every score between idle leaders, and ties break at random).
    Each test passes its own ``seed``: the EPP remembers every prompt it routed, so a follow-up
    that another test already sent elsewhere is rightly picked there again."""
    first, second = (chat_body(r.messages) for r in prefix_trace(1, 2, seed=seed, prefix_words=160))
    others = [name for name, e in pool.endpoints.items() if e != endpoint]
    for name in others:
        pool.set_routable(name, False)
    try:
        pool.wait_pool_size(len(pool.endpoints) - len(others), timeout=10)
        assert picks(pool, [first]) == [endpoint]
    finally:
        for name in others:
            pool.set_routable(name, True)
    pool.wait_pool_size(len(pool.endpoints), timeout=10)
    return [first, second]


def test_a_leader_labelled_not_routable_is_never_picked(pool):
    out_name, out = sorted(pool.endpoints.items())[1]
    first, follow_up = _prefix_living_on(pool, out, seed=100)
    pool.set_routable(out_name, False)
    try:
        left = pool.wait_pool_size(1, timeout=10)
        print(f"the EPP dropped {out_name} {left:.2f}s after its routable label flipped")
        # A prompt whose prefix is cached only there goes elsewhere too.
        chosen = picks(pool, fresh_bodies(6, seed=5) + [follow_up])
        assert out not in chosen, chosen
    finally:
        pool.set_routable(out_name, True)
    pool.wait_pool_size(2, timeout=10)


def test_prefix_affinity_to_a_leader_is_what_the_label_overrides(pool):
    # The counterpart of the test above: while routable, a follow-up of a prefix living on the
    # leader is picked there, so it was the label that moved it. Its own prompts: the test
    # above sent its follow-up to the other leader, and the EPP keeps that.
    _, there = sorted(pool.endpoints.items())[1]
    first, follow_up = _prefix_living_on(pool, there, seed=200)
    assert picks(pool, [follow_up]) == [there]


def test_a_leader_labelled_back_is_picked_again(pool):
    out_name, out = sorted(pool.endpoints.items())[1]
    pool.set_routable(out_name, False)
    pool.wait_pool_size(1, timeout=10)
    pool.set_routable(out_name, True)
    pool.wait_pool_size(2, timeout=10)
    assert out in picks(pool, fresh_bodies(8, seed=6))


@pytest.fixture(scope="module")
def smg_discovery(gie_pool, kube_cluster, tmp_path_factory):
    """SMG discovering the leaders by the routable-leader labels in the pool's namespace."""
    if smg_binary() is None:
        pytest.skip("smg is not installed (the gateway extra)")
    selector = [f"{k}={v}" for k, v in routable_leader_labels(gie_pool.name).items()]
    gateway = start_smg_discovery(selector, gie_pool.namespace, 8000, kube_cluster.kubeconfig,
                                  tmp_path_factory.mktemp("smg"))
    yield gateway
    gateway.stop()


def _smg_workers(gateway) -> set[str]:
    return {w["url"] for w in httpx.get(gateway.url + "/workers", timeout=10).json()["workers"]}


def _until(predicate, timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout
        time.sleep(0.1)
    return time.monotonic() - started


def test_smg_discovers_the_routable_leaders_by_label(pool, smg_discovery):
    want = {f"http://{e}" for e in pool.endpoints.values()}
    _until(lambda: _smg_workers(smg_discovery) == want, 60)
    assert _smg_workers(smg_discovery) == want


def test_smg_drops_a_leader_labelled_not_routable(pool, smg_discovery):
    out_name, out = sorted(pool.endpoints.items())[1]
    pool.set_routable(out_name, False)
    try:
        took = _until(lambda: f"http://{out}" not in _smg_workers(smg_discovery), 30)
        print(f"SMG dropped {out_name} {took:.2f}s after its routable label flipped")
        workers = _smg_workers(smg_discovery)
    finally:
        pool.set_routable(out_name, True)
    assert workers == {f"http://{e}" for e in pool.endpoints.values()} - {f"http://{out}"}


def test_smg_takes_a_leader_labelled_back(pool, smg_discovery):
    # smg 1.13 removes a pod on its watch event but adds one back only on its periodic
    # reconcile (about once a minute here).
    want = {f"http://{e}" for e in pool.endpoints.values()}
    took = _until(lambda: _smg_workers(smg_discovery) == want, 120)
    print(f"SMG had both leaders again {took:.2f}s later")
    assert _smg_workers(smg_discovery) == want
