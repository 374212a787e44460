"""``/v1/embeddings`` over HTTP on a live server running a tiny Qwen3 embedding model (last-token
pooling, normalised, trained "for Matryoshka"), compared with sentence-transformers; the
refusals between model kinds; and real clients pointed at ``base_url``: the openai SDK (which
asks for base64 by default) and LangChain's ``OpenAIEmbeddings``."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from serving_server import start_server

from shardline_runtime.tiny_embedding_checkpoint import make_tiny_embedding_checkpoint

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog again and again", "a b c"]


@pytest.fixture(scope="module")
def embedding_checkpoint(checkpoint_dir):
    path = checkpoint_dir / "qwen3-embedding"
    if not (path / "modules.json").exists():
        make_tiny_embedding_checkpoint(path, is_matryoshka=True)
    return path


@pytest.fixture(scope="module")
def embedding_server(embedding_checkpoint, checkpoint_dir):
    srv = start_server(embedding_checkpoint, checkpoint_dir, "--max-total-tokens", "1024",
                       "--chunked-prefill-size", "8", "--served-model-name", "tiny-embed")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(embedding_checkpoint):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(embedding_checkpoint), device="cpu")


def _vectors(response) -> torch.Tensor:
    assert response.status_code == 200, response.text
    return torch.tensor([item["embedding"] for item in response.json()["data"]])


def _error(response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_a_batch_of_strings_equals_sentence_transformers(embedding_server, reference):
    got = _vectors(embedding_server.post("/v1/embeddings", {"input": TEXTS, "model": "tiny-embed"}))
    expected = reference.encode(TEXTS, convert_to_tensor=True)
    assert (got - expected).abs().max().item() < 1e-4


def test_token_id_inputs_give_the_embeddings_of_their_strings(embedding_server, reference):
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS]
    by_ids = _vectors(embedding_server.post("/v1/embeddings", {"input": ids}))
    by_text = _vectors(embedding_server.post("/v1/embeddings", {"input": TEXTS}))
    assert (by_ids - by_text).abs().max().item() < 1e-6


def test_one_token_id_list_is_one_input(embedding_server, reference):
    ids = reference.tokenizer(TEXTS[0])["input_ids"]
    got = _vectors(embedding_server.post("/v1/embeddings", {"input": ids}))
    assert got.shape == (1, 64)


def test_base64_decodes_to_the_float_embedding(embedding_server):
    floats = _vectors(embedding_server.post("/v1/embeddings", {"input": TEXTS[1]}))[0]
    response = embedding_server.post("/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(response.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(decoded - floats.numpy()).max() < 1e-7


def test_dimensions_truncates_and_renormalises_as_sentence_transformers(embedding_server, reference):
    got = _vectors(embedding_server.post("/v1/embeddings", {"input": TEXTS, "dimensions": 16}))
    full = reference.encode(TEXTS, convert_to_tensor=True)
    expected = torch.nn.functional.normalize(full[:, :16], dim=1)
    assert (got - expected).abs().max().item() < 1e-4


def test_dimensions_past_the_hidden_size_is_a_400_naming_dimensions(embedding_server):
    error = _error(embedding_server.post("/v1/embeddings", {"input": "hi", "dimensions": 65}))
    assert error["param"] == "dimensions"


def test_usage_counts_the_tokens_of_every_input(embedding_server, reference):
    response = embedding_server.post("/v1/embeddings", {"input": TEXTS})
    tokens = sum(len(reference.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert response.json()["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_an_embedding_model_refuses_text_generation_naming_model(embedding_server, path):
    body = {"prompt": "hi", "text": "hi", "messages": [{"role": "user", "content": "hi"}]}
    assert _error(embedding_server.post(path, body))["param"] == "model"


def test_a_generation_model_refuses_embeddings_naming_model(server):
    assert _error(server.post("/v1/embeddings", {"input": "hi"}))["param"] == "model"


def test_model_info_says_the_model_does_not_generate(embedding_server):
    assert embedding_server.get("/get_model_info").json()["is_generation"] is False


def test_openai_sdk_embeddings_create_equals_sentence_transformers(embedding_server, reference):
    from openai import OpenAI

    client = OpenAI(base_url=embedding_server.url + "/v1", api_key="unused")
    response = client.embeddings.create(model="tiny-embed", input=TEXTS)  # base64 on the wire
    got = torch.tensor([item.embedding for item in response.data])
    assert (got - reference.encode(TEXTS, convert_to_tensor=True)).abs().max().item() < 1e-4


def test_langchain_openai_embeddings_equal_sentence_transformers(embedding_server, reference):
    from langchain_openai import OpenAIEmbeddings

    # check_embedding_ctx_length=False: send the strings (the default tokenizes with tiktoken)
    embeddings = OpenAIEmbeddings(model="tiny-embed", base_url=embedding_server.url + "/v1",
                                  api_key="unused", check_embedding_ctx_length=False)
    got = torch.tensor(embeddings.embed_documents(TEXTS) + [embeddings.embed_query(TEXTS[0])])
    expected = reference.encode([*TEXTS, TEXTS[0]], convert_to_tensor=True)
    assert (got - expected).abs().max().item() < 1e-4


def test_an_in_place_weight_update_serves_the_new_embeddings(embedding_server, embedding_checkpoint, checkpoint_dir):
    from sentence_transformers import SentenceTransformer

    revision_b = checkpoint_dir / "qwen3-embedding-b"
    if not (revision_b / "modules.json").exists():
        make_tiny_embedding_checkpoint(revision_b, is_matryoshka=True, seed=1)
    try:
        update = embedding_server.post("/update_weights_from_disk", {"model_path": str(revision_b)})
        assert update.json()["success"] is True, update.text
        got = _vectors(embedding_server.post("/v1/embeddings", {"input": TEXTS}))
        expected = SentenceTransformer(str(revision_b), device="cpu").encode(TEXTS, convert_to_tensor=True)
        assert (got - expected).abs().max().item() < 1e-4
    finally:
        embedding_server.post("/update_weights_from_disk", {"model_path": str(embedding_checkpoint)})
