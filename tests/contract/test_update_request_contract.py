"""Contract: the body the operator sends to ``/update_weights_from_disk`` validates against the
runtime's own request model, which rejects unknown keys (a misspelt key fails here, not in a pod).
"""

from __future__ import annotations

import pydantic
import pytest

from shardline_operator.rollout import update_body
from shardline_operator.runtime_args import ServedModel
from shardline_operator.spec import CudaGraphSpec
from shardline_runtime.entrypoints.protocol import UpdateWeightsRequest

GRAPHS_ON = CudaGraphSpec(enabled=True, max_batch_size=160)
CASES = {
    "new weights, same graphs": (ServedModel("/m/a", "a", GRAPHS_ON), ServedModel("/m/b", "b", GRAPHS_ON)),
    "graphs resized": (ServedModel("/m/a", "a", GRAPHS_ON), ServedModel("/m/a", "a", CudaGraphSpec(True, 32))),
    "graphs disabled": (ServedModel("/m/a", "a", GRAPHS_ON), ServedModel("/m/b", "b", CudaGraphSpec(False, 160))),
    "graphs enabled": (ServedModel("/m/a", "a", CudaGraphSpec(False, 160)), ServedModel("/m/a", "a", GRAPHS_ON)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_operator_update_body_validates_with_the_runtime_model(case):
    current, target = CASES[case]
    body = update_body(current, target)
    request = UpdateWeightsRequest.model_validate(body)
    assert request.model_path == target.path
    assert request.revision == target.revision
    assert request.recapture_cuda_graph is target.cuda_graph.enabled
    if target.cuda_graph != current.cuda_graph:
        assert request.disable_cuda_graph is (not target.cuda_graph.enabled)
        assert request.cuda_graph_max_bs == target.cuda_graph.max_batch_size
    else:
        assert request.disable_cuda_graph is None and request.cuda_graph_max_bs is None


def test_runtime_model_rejects_a_misspelt_key():
    body = update_body(*CASES["new weights, same graphs"])
    body["revison"] = body.pop("revision")
    with pytest.raises(pydantic.ValidationError) as err:
        UpdateWeightsRequest.model_validate(body)
    assert [e["loc"] for e in err.value.errors()] == [("revison",)]
