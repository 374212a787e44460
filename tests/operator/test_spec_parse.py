"""spec.py: defaults equal the CRD's, and every bad field gives an error naming it."""

from __future__ import annotations

import re

import pytest

from shardline_operator.spec import SpecError, parse_spec


def test_defaults_match_the_crd():
    spec = parse_spec("m", "ns", "uid", {"model": {"name": "m", "path": "/models/m/v1"}, "runtime": {"image": "i"}})
    assert spec.replicas == 1
    assert spec.parallelism.tensor == 1 and spec.parallelism.gpus_per_pod == 1
    assert spec.model.revision == "v1"  # last path component
    assert spec.model.mount_path == "/var/lib/shardline/models"
    assert spec.runtime.dtype == "auto" and spec.runtime.mem_fraction_static == 0.85
    assert spec.runtime.cuda_graph.enabled and spec.runtime.cuda_graph.max_batch_size == 160
    assert spec.weight_update.strategy == "InPlace" and spec.weight_update.timeout_seconds == 900
    assert spec.weight_update.rollback_on_failure is True
    assert spec.restart_policy.max_group_restarts == 5 and spec.restart_policy.backoff_seconds == 10
    assert spec.service.type == "ClusterIP" and spec.service.port == 8000


def test_pods_per_group(make_spec):
    assert make_spec({"parallelism": {"tensor": 8, "gpusPerPod": 4}}).parallelism.pods_per_group == 2


@pytest.mark.parametrize("overrides, field", [
    ({"parallelism": {"tensor": 3, "gpusPerPod": 2}}, "spec.parallelism: tensor (3) must be a multiple of gpusPerPod (2)"),
    ({"parallelism": {"tensor": 0}}, "spec.parallelism.tensor must be in [1, 1024]"),
    ({"replicas": -1}, "spec.replicas must be in [0, 100]"),
    ({"replicas": True}, "spec.replicas must be of type integer"),
    ({"replicas": "2"}, "spec.replicas must be of type integer"),
    ({"model": {"name": "m", "path": "relative/dir"}}, "spec.model.path must be an absolute"),
    ({"model": {"path": "/m"}}, "spec.model.name is required"),
    ({"model": {"name": "m", "path": "/m/v1", "revision": "bad revision!"}}, "spec.model.revision must be"),
    ({"model": {"name": "m", "path": "/elsewhere/v1", "volume": {"hostPath": {"path": "/x"}}}},
     "spec.model.path (/elsewhere/v1) must be inside spec.model.mountPath"),
    ({"model": {"name": "m", "path": "/var/lib/shardline/models/v1", "volume": {"hostPath": {}, "emptyDir": {}}}},
     "spec.model.volume must hold exactly one volume source"),
    ({"runtime": {}}, "spec.runtime.image is required"),
    ({"runtime": {"image": "i", "dtype": "int4"}}, "spec.runtime.dtype must be one of auto, float32, float16, bfloat16"),
    ({"runtime": {"image": "i", "kvCacheDtype": "int8"}},
     "spec.runtime.kvCacheDtype must be one of auto, bfloat16, float16, fp8_e4m3, fp8_e5m2"),
    ({"runtime": {"image": "i", "memFractionStatic": 0}}, "spec.runtime.memFractionStatic must be in (0, 1]"),
    ({"runtime": {"image": "i", "args": ["--tp-size=4"]}}, "spec.runtime.args must not set --tp-size"),
    ({"runtime": {"image": "i", "args": [7]}}, "spec.runtime.args must be a list of strings"),
    ({"runtime": {"image": "i", "args": ["--drain-timeout", "soon"]}},
     "spec.runtime.args --drain-timeout must be followed by whole seconds in [0, 86400]"),
    ({"runtime": {"image": "i", "args": ["--drain-timeout"]}},
     "spec.runtime.args --drain-timeout must be followed by whole seconds"),
    ({"runtime": {"image": "i", "args": ["--drain-timeout=-5"]}},
     "spec.runtime.args --drain-timeout must be followed by whole seconds"),
    ({"runtime": {"image": "i", "env": [{"name": "POD_IP", "value": "x"}]}}, "spec.runtime.env must not set POD_IP"),
    ({"runtime": {"image": "i", "resources": {"limits": {"nvidia.com/gpu": 2}}}},
     "spec.runtime.resources.limits must not set nvidia.com/gpu"),
    ({"runtime": {"image": "i", "cudaGraph": {"maxBatchSize": 0}}}, "spec.runtime.cudaGraph.maxBatchSize must be in [1, 4096]"),
    ({"weightUpdate": {"strategy": "Rolling"}}, "spec.weightUpdate.strategy must be one of InPlace, Restart"),
    ({"weightUpdate": {"maxUnavailable": 0}}, "spec.weightUpdate.maxUnavailable must be in [1, 100]"),
    ({"weightUpdate": {"pauseSeconds": -1}}, "spec.weightUpdate.pauseSeconds must be in [0, 86400]"),
    ({"weightUpdate": {"canary": {"verify": {}}}}, "spec.weightUpdate.canary.verify.prompt is required"),
    ({"weightUpdate": {"canary": {"verify": {"prompt": "  "}}}}, "spec.weightUpdate.canary.verify.prompt must be"),
    ({"weightUpdate": {"canary": {"verify": {"prompt": "hi", "maxLatencySeconds": 0}}}},
     "spec.weightUpdate.canary.verify.maxLatencySeconds must be in (0, 600]"),
    ({"weightUpdate": {"strategy": "Restart", "canary": {}}}, "spec.weightUpdate.canary applies to strategy InPlace"),
    ({"restartPolicy": {"maxGroupRestarts": -2}}, "spec.restartPolicy.maxGroupRestarts must be in [0, 1000]"),
    ({"service": {"type": "ExternalName"}}, "spec.service.type must be one of ClusterIP, NodePort, LoadBalancer"),
    ({"service": {"port": 70000}}, "spec.service.port must be in [1, 65535]"),
])
def test_invalid_field_is_named(make_spec, overrides, field):
    with pytest.raises(SpecError) as info:
        make_spec(overrides)
    assert field in str(info.value)


@pytest.mark.parametrize("name", ["UpperCase", "a" * 41, "1starts-with-digit", "under_score"])
def test_invalid_names(make_spec, name):
    with pytest.raises(SpecError, match="metadata.name must be a DNS-1035 label"):
        make_spec(name=name)


def test_restart_hash_ignores_in_place_fields(make_spec):
    base = make_spec()
    moved = make_spec({"model": {**make_spec().model.__dict__, "name": "tiny-llama", "path":
                                 "/var/lib/shardline/models/tiny-llama/rev-b", "revision": "rev-b",
                                 "mountPath": "/var/lib/shardline/models",
                                 "volume": {"hostPath": {"path": "/var/lib/shardline/models", "type": "DirectoryOrCreate"}}},
                       "replicas": 5, "weightUpdate": {"strategy": "Restart"}})
    graphs = make_spec({"runtime": {"image": "ghcr.io/shardline/shardline-runtime:0.1.0", "resources": {"limits": {"cpu": "2"}},
                                    "cudaGraph": {"maxBatchSize": 8}}})
    image = make_spec({"runtime": {"image": "ghcr.io/shardline/shardline-runtime:0.2.0", "resources": {"limits": {"cpu": "2"}}}})
    assert base.restart_hash() == moved.restart_hash() == graphs.restart_hash()
    assert base.restart_hash() != image.restart_hash()


def test_expert_parallelism_defaults_to_one_and_reaches_the_runtime(make_spec):
    from shardline_operator.runtime_args import ServedModel, runtime_args

    assert make_spec({}).parallelism.expert == 1
    spec = make_spec({"parallelism": {"tensor": 4, "gpusPerPod": 2, "expert": 2}})
    args = runtime_args(spec, 0, ServedModel.desired(spec))
    assert args[args.index("--ep-size") + 1] == "2"
    assert "--ep-size" not in runtime_args(make_spec({}), 0, ServedModel.desired(make_spec({})))


@pytest.mark.parametrize("parallelism, message", [
    ({"tensor": 4, "expert": 3}, "spec.parallelism: expert (3) must divide tensor (4): experts are split over expert "
                                 "groups of tensor / expert ranks; allowed: [1, 2, 4]"),
    ({"tensor": 2, "expert": 0}, "spec.parallelism.expert must be in [1, 1024]"),
])
def test_expert_parallelism_that_does_not_divide_the_ranks_is_refused(make_spec, parallelism, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        make_spec({"parallelism": parallelism})


def test_runtime_quantization_defaults_to_auto():
    spec = parse_spec("m", "ns", "u", {"model": {"name": "m", "path": "/var/lib/shardline/models/m/v1"},
                                       "runtime": {"image": "i"}})
    assert spec.runtime.quantization == "auto"


def test_runtime_quantization_unknown_value_names_the_field_and_choices():
    with pytest.raises(SpecError, match="spec.runtime.quantization must be one of auto, fp8"):
        parse_spec("m", "ns", "u", {"model": {"name": "m", "path": "/var/lib/shardline/models/m/v1"},
                                    "runtime": {"image": "i", "quantization": "awq"}})
