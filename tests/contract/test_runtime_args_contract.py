"""Contract: the operator's rendered runtime arguments parse with the runtime's own parser.

Kubelet expands ``$(VAR)`` in args from the container env before exec; the test does the same
with the values a pod would have, then parses with ``shardline_runtime.server_args``.
"""

from __future__ import annotations

import re

import pytest

from shardline_operator.render import render_children
from shardline_operator.spec import parse_spec
from shardline_runtime import server_args

SPECS = {
    "single-pod": {"model": {"name": "tiny", "path": "/models/tiny/rev-a"}, "runtime": {"image": "r:1"}},
    "tp2-two-pods": {
        "replicas": 2,
        "model": {"name": "tiny", "path": "/var/lib/shardline/models/tiny/rev-a", "revision": "rev-a",
                  "volume": {"hostPath": {"path": "/var/lib/shardline/models"}}},
        "parallelism": {"tensor": 2, "gpusPerPod": 1},
        "runtime": {"image": "r:1", "dtype": "float32", "kvCacheDtype": "fp8_e4m3", "quantization": "fp8", "memFractionStatic": 0.5, "maxTotalTokens": 2048,
                    "cudaGraph": {"enabled": False}, "args": ["--log-level", "debug"]},
    },
    "tp8-two-pods": {"model": {"name": "big", "path": "/models/big/v1"}, "parallelism": {"tensor": 8, "gpusPerPod": 4},
                     "runtime": {"image": "r:1", "cudaGraph": {"maxBatchSize": 32}}},
    "moe-ep4": {"model": {"name": "moe", "path": "/models/moe/v1"}, "parallelism": {"tensor": 8, "gpusPerPod": 4, "expert": 4},
                "runtime": {"image": "r:1", "args": ["--ep-num-redundant-experts", "8"]}},
    "tp2-pp2-two-pods": {"model": {"name": "pp", "path": "/models/pp/v1"},
                         "parallelism": {"tensor": 2, "pipeline": 2, "gpusPerPod": 2}, "runtime": {"image": "r:1"}},
    "tp2-pp2-four-pods": {"model": {"name": "pp", "path": "/models/pp/v1"},
                          "parallelism": {"tensor": 2, "pipeline": 2, "gpusPerPod": 1, "pipelineLayerPartition": [3, 5]},
                          "runtime": {"image": "r:1"}},
    "pp4-two-stages-per-pod": {"model": {"name": "pp", "path": "/models/pp/v1"},
                               "parallelism": {"tensor": 1, "pipeline": 4, "gpusPerPod": 2}, "runtime": {"image": "r:1"}},
    "embedding-model": {"model": {"name": "emb", "path": "/models/emb/v1", "kind": "embed"},
                        "parallelism": {"tensor": 2, "gpusPerPod": 2}, "runtime": {"image": "r:1"}},
    "tp2-speculative-ngram": {"model": {"name": "tiny", "path": "/models/tiny/rev-a"}, "parallelism": {"tensor": 2, "gpusPerPod": 2},
                              "runtime": {"image": "r:1", "speculative": {"algorithm": "NGRAM", "numDraftTokens": 6}}},
    "speculative-standalone": {"model": {"name": "tiny", "path": "/models/tiny/rev-a"},
                               "runtime": {"image": "r:1", "speculative": {"algorithm": "STANDALONE",
                                                                           "draftModel": {"path": "/models/draft"}}}},
}


def expand(text: str, env: dict[str, str]) -> str:
    """Kubelet's ``$(VAR)`` expansion (``$$`` escapes; unknown references stay as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def pods(spec_name: str):
    spec = parse_spec("llama", "serving", "uid", SPECS[spec_name])
    for child in render_children(spec):
        if child["kind"] != "StatefulSet":
            continue
        group = int(child["metadata"]["name"].rsplit("-g", 1)[1])
        container = child["spec"]["template"]["spec"]["containers"][0]
        for rank in range(child["spec"]["replicas"]):
            env = {"POD_IP": f"127.0.0.{10 + rank}", "POD_INDEX": str(rank),
                   "POD_NAME": f"{child['metadata']['name']}-{rank}", "POD_NAMESPACE": "serving"}
            yield spec, group, rank, container, [expand(a, env) for a in container["args"]]


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_rendered_args_parse_with_the_runtime_parser(spec_name):
    seen = 0
    for spec, group, rank, container, argv in pods(spec_name):
        assert container["command"] == ["shardline-runtime", "serve"]
        args = server_args.ServerArgs.from_cli(argv)
        seen += 1
        assert args.model_path == spec.model.path
        assert args.served_model_name == spec.model.name
        assert args.revision == spec.model.revision
        assert args.tp_size == spec.parallelism.tensor
        assert args.pp_size == spec.parallelism.pipeline
        assert tuple(args.pp_layer_partition) == spec.parallelism.pipeline_layer_partition
        assert args.ep_size == spec.parallelism.expert
        assert args.nnodes == spec.parallelism.pods_per_group
        assert args.node_rank == rank
        assert args.host == f"127.0.0.{10 + rank}"
        assert args.port == 8000
        assert args.dist_init_addr == f"llama-g{group}-0.llama-g{group}-ranks.serving.svc:{29500 + group}"
        assert args.dtype == spec.runtime.dtype
        assert args.kv_cache_dtype == spec.runtime.kv_cache_dtype
        assert args.quantization == spec.runtime.quantization
        assert args.model_kind == spec.model.kind
        assert args.mem_fraction_static == spec.runtime.mem_fraction_static
        assert args.max_total_tokens == spec.runtime.max_total_tokens
        assert args.disable_cuda_graph == (not spec.runtime.cuda_graph.enabled)
        if spec.runtime.cuda_graph.enabled:
            assert args.cuda_graph_max_bs == spec.runtime.cuda_graph.max_batch_size
    assert seen == spec.replicas * spec.parallelism.pods_per_group


def test_user_args_reach_the_runtime():
    *_, argv = next(pods("tp2-two-pods"))
    assert server_args.ServerArgs.from_cli(argv).log_level == "debug"


def test_model_kind_choices_match():
    from shardline_operator.spec import MODEL_KINDS
    from shardline_runtime.configs.pooling_config import MODEL_KINDS as RUNTIME_MODEL_KINDS

    assert RUNTIME_MODEL_KINDS == MODEL_KINDS


def test_quantization_choices_match():
    from shardline_operator.spec import QUANTIZATION_MODES
    from shardline_runtime.layers.quantization.online_fp8 import ONLINE_CHOICES

    assert ONLINE_CHOICES == QUANTIZATION_MODES


def test_kv_cache_dtype_choices_match():
    from shardline_operator.spec import KV_CACHE_DTYPES

    assert tuple(server_args.KV_CACHE_DTYPES) == KV_CACHE_DTYPES


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_runtime_runs_the_ranks_the_operator_reports_for_each_pod(spec_name):
    """The (pp, tp) ranks in ``status.groups[].ranks[]`` are the ones the runtime starts on that pod."""
    from shardline_runtime.distributed.parallel_state import rank_layout, tp_ranks_of_node

    for spec, _, rank, _, argv in pods(spec_name):
        args = server_args.ServerArgs.from_cli(argv)
        started = {rank_layout(r, args.tp_size) for r in tp_ranks_of_node(args.tp_size, args.nnodes, args.node_rank,
                                                                          args.pp_size)}
        reported = spec.parallelism.pod_ranks(rank)
        assert started == {(pp, tp) for pp in reported.pp_ranks for tp in reported.tp_ranks}
        assert len(started) == spec.parallelism.gpus_per_pod


def test_speculative_spec_reaches_the_runtime_section():
    _, _, _, _, args = next(pods("tp2-speculative-ngram"))
    parsed = server_args.ServerArgs.from_cli(args)
    assert parsed.speculative.speculative_algorithm == "NGRAM"
    assert parsed.speculative.speculative_num_draft_tokens == 6


def test_draft_model_path_reaches_the_runtime_section():
    _, _, _, _, args = next(pods("speculative-standalone"))
    parsed = server_args.ServerArgs.from_cli(args)
    assert parsed.speculative.speculative_draft_model_path == "/models/draft"


def test_every_crd_speculative_algorithm_is_implemented_by_the_runtime():
    from shardline_operator.spec_types import SPECULATIVE_ALGORITHMS
    from shardline_runtime.speculative.spec_args import IMPLEMENTED_ALGORITHMS

    assert set(SPECULATIVE_ALGORITHMS) <= set(IMPLEMENTED_ALGORITHMS)


def test_operator_knows_the_runtimes_default_drain_timeout():
    from shardline_operator.spec_types import RUNTIME_DRAIN_TIMEOUT_SECONDS

    parsed = server_args.ServerArgs.from_cli(["--model-path", "/m"])
    assert parsed.drain_timeout == RUNTIME_DRAIN_TIMEOUT_SECONDS
