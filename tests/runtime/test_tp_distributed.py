"""distributed/: gloo collectives on CPU, no-ops at tp_size 1, rendezvous address handling and
retry while the rank-0 name does not resolve, and a dead peer ending in an error (K3)."""

import socket

import pytest
import torch
import torch.multiprocessing as mp

import harness
from shardline_runtime import distributed as D
from shardline_runtime.distributed import parallel_state


def spawn_two(tmp_path, die_rank=None, timeout_s=10.0, join_timeout=120, hang=False):
    port = harness.free_port()
    ctx = mp.spawn(harness.collectives_worker, args=(port, str(tmp_path), die_rank, timeout_s, hang), nprocs=2, join=False)
    for rank, p in enumerate(ctx.processes):
        if hang and rank == die_rank:
            continue
        p.join(join_timeout)
        assert p.exitcode is not None, f"rank {rank} hung"
    for p in ctx.processes:
        if p.exitcode is None:
            p.kill()
            p.join()
    return {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(2) if (tmp_path / f"rank{r}.pt").exists()}


@pytest.mark.slow
def test_gloo_collectives_two_ranks(tmp_path):
    res = spawn_two(tmp_path)
    for r in (0, 1):
        assert res[r]["all_reduce"] == [3.0, 3.0, 3.0]
        assert res[r]["all_gather"] == [[0, 0, 1, 1]]
        assert res[r]["pyobj"] == {"reqs": ["a", 0]}
        assert res[r]["min"] == 10


@pytest.mark.slow
def test_dead_peer_ends_in_error_not_hang(tmp_path):
    res = spawn_two(tmp_path, die_rank=1, timeout_s=5.0)
    assert res[0]["error"] is not None
    assert res[0]["elapsed_s"] < 30


@pytest.mark.slow
def test_stuck_peer_ends_in_timeout_error(tmp_path):
    res = spawn_two(tmp_path, die_rank=1, timeout_s=3.0, hang=True)
    assert res[0]["error"] is not None
    assert res[0]["elapsed_s"] < 20


def test_collectives_are_noops_at_tp1():
    D.init_distributed_environment(0, 1, torch.device("cpu"))
    x = torch.ones(3)
    assert D.tensor_model_parallel_all_reduce(x) is x
    assert D.tensor_model_parallel_all_gather(x) is x
    assert D.broadcast_pyobj([1, 2]) == [1, 2]
    assert D.all_reduce_min_int(7) == 7
    assert D.get_tensor_model_parallel_world_size() == 1


def test_split_host_port_and_node_ranks():
    assert parallel_state.split_host_port("name-g0-0.name-g0-ranks.ns.svc:29500") == ("name-g0-0.name-g0-ranks.ns.svc", 29500)
    assert parallel_state.split_host_port("[::1]:1234") == ("::1", 1234)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parallel_state.split_host_port("nohost")
    assert list(D.tp_ranks_of_node(8, 2, 1)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="divisible"):
        D.tp_ranks_of_node(6, 4, 0)


def test_rendezvous_host_resolution_is_retried(monkeypatch):
    calls = []
    real = socket.getaddrinfo

    def flaky(host, *args, **kwargs):
        calls.append(host)
        if len(calls) < 3:
            raise socket.gaierror(-2, "Name or service not known")
        return real("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", flaky)
    parallel_state.wait_for_host("rank0.not-yet.svc", timeout_s=10, interval_s=0.01)
    assert len(calls) == 3


def test_rendezvous_host_never_resolving_fails_with_name(monkeypatch):
    def never(host, *args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", never)
    with pytest.raises(D.DistributedInitError, match="'rank0.gone.svc' did not resolve within 0.05s"):
        parallel_state.wait_for_host("rank0.gone.svc", timeout_s=0.05, interval_s=0.01)


def test_tp_size_above_one_needs_address():
    with pytest.raises(D.DistributedInitError, match="needs dist_init_addr"):
        D.init_distributed_environment(0, 2, torch.device("cpu"), None)
