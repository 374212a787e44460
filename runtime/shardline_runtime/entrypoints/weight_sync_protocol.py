"""Request bodies of the weight-sync, pause and memory endpoints (pydantic; 400 names the field).

Field names and defaults follow SGLang's HTTP API, so RL frameworks written against SGLang
(verl, slime, AReaL, OpenRLHF) send the same bodies. See docs/api.md.

Unknown fields are a 400 naming them (unlike the OpenAI bodies): these calls free memory, join
process groups and overwrite weights, so a misspelt field (``tag`` for ``tags``) must not fall
back to a default that does something else (release every tag, weights included).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

WeightVersion = str | None
_VERSION = Field(None, min_length=1, max_length=256)
_STRICT = ConfigDict(extra="forbid")
Dimension = Annotated[int, Field(ge=0)]


class InitWeightsUpdateGroupRequest(BaseModel):
    """``POST /init_weights_update_group``: engine rank ``r = pp_rank * tp_size + tp_rank`` joins as
    ``rank_offset + r``."""

    model_config = _STRICT

    master_address: str = Field(..., min_length=1)
    master_port: int = Field(..., ge=1, le=65535)
    rank_offset: int = Field(1, ge=1)
    world_size: int = Field(..., ge=2)
    group_name: str = Field("weight_update_group", min_length=1, max_length=128)
    backend: Literal["gloo", "nccl"] = "nccl"
    timeout_s: float = Field(120.0, gt=0, le=3600)


class DestroyWeightsUpdateGroupRequest(BaseModel):
    model_config = _STRICT

    group_name: str = Field("weight_update_group", min_length=1, max_length=128)


class UpdateWeightsFromDistributedRequest(BaseModel):
    """``POST /update_weights_from_distributed``: the trainer broadcasts ``names`` in order."""

    model_config = _STRICT

    names: list[str] = Field(..., min_length=1)
    dtypes: list[str] = Field(..., min_length=1)
    shapes: list[list[Dimension]] = Field(..., min_length=1)
    group_name: str = Field("weight_update_group", min_length=1, max_length=128)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: WeightVersion = _VERSION
    # SGLang's clients send it (null: one broadcast per tensor, the only layout served here).
    load_format: None = None


class UpdateWeightsFromTensorRequest(BaseModel):
    """``POST /update_weights_from_tensor``: base64 of the bytes of one safetensors file."""

    model_config = _STRICT

    serialized_named_tensors: str = Field(..., min_length=1)
    load_format: Literal["safetensors"] = "safetensors"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: WeightVersion = _VERSION


class GetWeightsByNameRequest(BaseModel):
    model_config = _STRICT

    name: str = Field(..., min_length=1)
    truncate_size: int = Field(100, ge=1, le=65536)


class PauseGenerationRequest(BaseModel):
    model_config = _STRICT

    mode: Literal["abort", "retract", "in_place"] = "abort"


class MemoryOccupationRequest(BaseModel):
    """``tags``: any of ``weights``, ``kv_cache``, ``cuda_graph``; absent or null means all."""

    model_config = _STRICT

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None
