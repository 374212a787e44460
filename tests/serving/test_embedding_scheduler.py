"""Embedding models through the real scheduler and TpModelWorker (CPU, in-process), against
sentence-transformers on the same tiny checkpoint: last-token, mean and CLS pooling, with and
without normalisation, inputs chunked by chunked prefill and batched together."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from scheduler_harness import make_scheduler

from shardline_runtime.configs.model_config import ModelConfig, ModelConfigError
from shardline_runtime.managers.io_struct import BatchTokenOut, TokenizedGenerateReqInput
from shardline_runtime.sampling.sampling_params import SamplingParams
from shardline_runtime.tiny_embedding_checkpoint import make_tiny_embedding_checkpoint

TEXTS = [
    "hello world",
    "the model serves tokens over a tensor parallel group of pods each rank holds a shard of every weight",
    "a",
    "kubernetes restarts the whole group when one member fails",
]


@pytest.fixture(scope="module")
def embedding_checkpoint(tmp_path_factory):
    """Last-token pooling, normalised, not Matryoshka: the checkpoint the config tests read."""
    return make_tiny_embedding_checkpoint(tmp_path_factory.mktemp("emb") / "emb")


def _copy(path, tmp_path):
    return shutil.copytree(path, tmp_path / "copy")


def _embed(scheduler, input_ids: list[list[int]]) -> torch.Tensor:
    msgs = [
        TokenizedGenerateReqInput(rid=str(i), input_ids=ids, sampling_params=SamplingParams(max_new_tokens=0))
        for i, ids in enumerate(input_ids)
    ]
    scheduler.process_input_requests(msgs)
    for _ in range(500):
        batch = scheduler.get_next_batch_to_run()
        if batch is None and scheduler.is_idle():
            break
        if batch is not None:
            scheduler.results.process(batch, scheduler.run_batch(batch))
    got = {o.rid: o.embedding for m in scheduler.sender.socket.messages if isinstance(m, BatchTokenOut)
           for o in m.outs if o.finish is not None}
    return torch.tensor([got[str(i)] for i in range(len(input_ids))])


@pytest.mark.parametrize(
    ("pooling", "normalize", "base_architecture"),
    [("lasttoken", True, False), ("mean", False, False), ("cls", True, True)],
)
def test_pooled_embeddings_equal_sentence_transformers(tmp_path, pooling, normalize, base_architecture):
    from sentence_transformers import SentenceTransformer

    path = make_tiny_embedding_checkpoint(tmp_path / "emb", pooling=pooling, normalize=normalize,
                                          base_architecture=base_architecture)
    reference = SentenceTransformer(str(path), device="cpu")
    expected = reference.encode(TEXTS, convert_to_tensor=True)
    scheduler = make_scheduler(path, chunked_prefill_size=8)  # the long input runs in 3 chunks
    got = _embed(scheduler, [reference.tokenizer(t)["input_ids"] for t in TEXTS])
    assert (got - expected).abs().max().item() < 1e-4


def test_embedding_checkpoint_is_not_a_generation_model(embedding_checkpoint):
    assert ModelConfig.from_pretrained(embedding_checkpoint).is_generation is False


def test_matryoshka_flag_allows_every_width_up_to_hidden_size(embedding_checkpoint, tmp_path):
    path = _copy(embedding_checkpoint, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    assert ModelConfig.from_pretrained(path).pooling.dimensions_problem(16) is None


def test_dimensions_on_a_model_without_matryoshka_training_names_the_reason(embedding_checkpoint):
    pooling = ModelConfig.from_pretrained(embedding_checkpoint).pooling
    assert "Matryoshka" in pooling.dimensions_problem(16)


def test_a_dense_projection_module_is_refused_naming_modules_json(embedding_checkpoint, tmp_path):
    path = _copy(embedding_checkpoint, tmp_path)
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ModelConfigError, match="modules.json.*Dense"):
        ModelConfig.from_pretrained(path)


def test_max_pooling_is_refused_naming_the_supported_modes(embedding_checkpoint, tmp_path):
    path = _copy(embedding_checkpoint, tmp_path)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    with pytest.raises(ModelConfigError, match="pooling_mode.*lasttoken"):
        ModelConfig.from_pretrained(path)


def test_a_declared_generate_kind_refuses_an_embedding_checkpoint(embedding_checkpoint):
    path = embedding_checkpoint
    with pytest.raises(ModelConfigError, match="--model-kind generate: the checkpoint is an embedding model"):
        make_scheduler(path, model_kind="generate")
