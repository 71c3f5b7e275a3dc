"""Real client libraries, unchanged, against a server of the embedding model (all-MiniLM-L6-v2): the openai
client's ``embeddings.create`` (it asks for base64 by default), langchain's ``OpenAIEmbeddings`` and
litellm's ``embedding``, each matching the offline vectors; and a small retrieval check through
``/v1/rerank``: the passage that answers each question is ranked first. vLLM's other pooling routes in
the shapes its clients read (raw httpx): ``/pooling``, Cohere's ``/v2/embed`` with every embedding type,
``/v1/score`` under each of its field names, one query scored and ranked against many and counted once; and
Cohere's own SDK (``cohere.ClientV2.embed``) on a copy of the model that defines input-type prompts."""

from __future__ import annotations

import base64
import os

import numpy as np
import pytest
import requests

from stage5_server import LLM
from stage5_server.config.model import resolve_model
from stage5_server.server import create_app
from tests.stage5.server_fixtures import auth, running_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
KEY = "test-key-embedding-clients"
MODEL = "all-minilm-l6-v2"
TEXTS = ["The KV cache is split into fixed-size blocks.", "Bananas are rich in potassium."]
PASSAGES = ["The Eiffel Tower is in Paris, the capital of France.",
            "Photosynthesis turns light, water and carbon dioxide into sugar in plant leaves.",
            "The Pacific is the largest and deepest ocean on Earth.",
            "A transformer's attention lets every token look at the others."]
QUESTIONS = {"Where is the Eiffel Tower?": 0, "How do plants make sugar from sunlight?": 1,
             "Which ocean is the biggest?": 2, "What does attention do in a transformer?": 3}


@pytest.fixture(scope="module")
def llm():
    return LLM(resolve_model(MODEL), dtype="float32", max_num_seqs=8)


@pytest.fixture(scope="module")
def server(llm, expected, references):  # the offline results first: once serving, the server's thread drives
    # the engine
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    with running_server(app) as running:
        yield running.url


@pytest.fixture(scope="module")
def expected(llm):
    return np.array([o.outputs.embedding for o in llm.embed(TEXTS)])


TRUNCATED = "alpha beta gamma delta epsilon zeta eta theta"


@pytest.fixture(scope="module")
def references(llm):
    ids = llm.tokenizer.encode(TRUNCATED)
    head, tail = llm.embed([ids[:4] + ids[-1:], ids[:1] + ids[-4:]])  # [CLS] + the first / last 3 tokens + [SEP]
    query = list(QUESTIONS)[0]
    return {"head": head.outputs.embedding, "tail": tail.outputs.embedding,
            "scores": [o.outputs.score for o in llm.score(query, PASSAGES)]}


def test_openai_client_embeddings_create(server, expected):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)
    result = client.embeddings.create(model=MODEL, input=TEXTS)
    assert np.allclose([d.embedding for d in result.data], expected, atol=1e-6)
    as_floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert np.allclose(as_floats.data[0].embedding, expected[0], atol=1e-6)


def test_langchain_openai_embeddings_documents_and_query(server, expected):
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model=MODEL, base_url=f"{server}/v1", api_key=KEY, max_retries=0,
                                  check_embedding_ctx_length=False)  # else it tokenizes with tiktoken
    assert np.allclose(embeddings.embed_documents(TEXTS), expected, atol=1e-6)
    assert np.allclose(embeddings.embed_query(TEXTS[1]), expected[1], atol=1e-6)


def test_litellm_embedding(server, expected):
    import litellm

    response = litellm.embedding(model=f"openai/{MODEL}", api_base=f"{server}/v1", api_key=KEY, input=TEXTS)
    assert np.allclose([d["embedding"] for d in response.data], expected, atol=1e-6)


def test_rerank_puts_the_answering_passage_first_for_each_question(server):
    for question, answer in QUESTIONS.items():
        body = requests.post(f"{server}/v1/rerank", headers=auth(KEY), timeout=60,
                             json={"model": MODEL, "query": question, "documents": PASSAGES}).json()
        assert body["results"][0]["index"] == answer, (question, body["results"])


def post(server: str, path: str, body: dict) -> dict:
    response = requests.post(f"{server}{path}", headers=auth(KEY), timeout=60, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def tokens(llm, text: str) -> int:
    return len(llm.tokenizer.encode(text))


def test_pooling_returns_the_raw_pooled_vectors_in_vllms_shape(server, expected, llm):
    body = post(server, "/pooling", {"input": TEXTS})
    assert body["object"] == "list" and body["id"].startswith("pool-")
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "pooling"), (1, "pooling")]
    assert np.allclose([d["data"] for d in body["data"]], expected, atol=1e-6)
    assert body["usage"]["prompt_tokens"] == sum(tokens(llm, t) for t in TEXTS)
    packed = post(server, "/pooling", {"input": TEXTS[0], "encoding_format": "base64"})["data"][0]["data"]
    assert np.allclose(np.frombuffer(base64.b64decode(packed), dtype="<f4"), expected[0], atol=1e-6)


def test_cohere_embed_v2_returns_each_embedding_type(server, expected, llm):
    body = post(server, "/v2/embed", {"texts": TEXTS, "embedding_types": ["float", "base64", "binary", "ubinary"]})
    assert set(body) == {"id", "embeddings", "texts", "meta", "response_type"} and body["texts"] == TEXTS
    assert body["response_type"] == "embeddings_by_type"
    assert body["meta"] == {"api_version": {"version": "2"},
                            "billed_units": {"input_tokens": sum(tokens(llm, t) for t in TEXTS)}}
    embeddings = body["embeddings"]
    assert np.allclose(embeddings["float"], expected, atol=1e-6)
    decoded = [np.frombuffer(base64.b64decode(b), dtype="<f4") for b in embeddings["base64"]]
    assert np.allclose(decoded, expected, atol=1e-6)
    bits = np.packbits(expected >= 0, axis=-1)  # 384 dimensions -> 48 bytes, the first dimension highest
    assert embeddings["ubinary"] == bits.tolist() and embeddings["binary"] == (bits.astype(int) - 128).tolist()
    assert len(embeddings["ubinary"][0]) == 48
    assert set(post(server, "/v2/embed", {"texts": TEXTS[:1]})["embeddings"]) == {"float"}  # the default type


def test_cohere_embed_truncates_from_either_end(server, references):
    end = post(server, "/v2/embed", {"texts": [TRUNCATED], "truncate": "END", "max_tokens": 5})
    start = post(server, "/v2/embed", {"texts": [TRUNCATED], "truncate": "START", "max_tokens": 5})
    assert np.allclose(end["embeddings"]["float"][0], references["head"], atol=1e-6)
    assert np.allclose(start["embeddings"]["float"][0], references["tail"], atol=1e-6)
    assert start["meta"]["billed_units"]["input_tokens"] == 5


@pytest.mark.parametrize("sides", [("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"),
                                   ("queries", "items")])
def test_score_takes_each_of_vllms_field_names_and_embeds_one_query_once(server, llm, references, sides):
    query, documents = QUESTIONS_LIST[0], PASSAGES
    body = post(server, "/v1/score", {sides[0]: query, sides[1]: documents})
    assert np.allclose([d["score"] for d in body["data"]], references["scores"], atol=1e-6)
    once = tokens(llm, query) + sum(tokens(llm, d) for d in documents)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == once
    pairs = post(server, "/v1/score", {sides[0]: [query] * 2, sides[1]: documents[:2]})  # N to N: each side counted
    assert pairs["usage"]["prompt_tokens"] == 2 * tokens(llm, query) + sum(tokens(llm, d) for d in documents[:2])


def test_rerank_usage_has_prompt_tokens_beside_total_tokens(server, llm):
    body = post(server, "/v1/rerank", {"query": QUESTIONS_LIST[1], "documents": PASSAGES})
    once = tokens(llm, QUESTIONS_LIST[1]) + sum(tokens(llm, d) for d in PASSAGES)
    assert body["usage"] == {"prompt_tokens": once, "total_tokens": once}


QUESTIONS_LIST = list(QUESTIONS)


@pytest.fixture(scope="module")
def prompted_model(tmp_path_factory):
    """The embedding model with sentence-transformers prompts for two input types, as e5-style models ship."""
    import json
    import shutil

    model = tmp_path_factory.mktemp("prompted") / MODEL
    shutil.copytree(resolve_model(MODEL), model)
    settings = model / "config_sentence_transformers.json"
    config = json.loads(settings.read_text())
    settings.write_text(json.dumps({**config, "prompts": {"search_query": "query: ", "search_document": "passage: "}}))
    return model


def test_cohere_sdk_embeds_with_the_models_input_type_prompts(prompted_model):
    import cohere

    llm = LLM(str(prompted_model), dtype="float32", max_num_seqs=8)
    embedded_queries = llm.embed([f"query: {t}" for t in TEXTS])
    queries = np.array([o.outputs.embedding for o in embedded_queries])
    passages = np.array([o.outputs.embedding for o in llm.embed([f"passage: {t}" for t in TEXTS])])
    prompt_tokens = sum(len(o.prompt_token_ids) for o in embedded_queries)
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    with running_server(app) as running:
        client = cohere.ClientV2(api_key=KEY, base_url=running.url, timeout=60)
        answer = client.embed(model=MODEL, texts=TEXTS, input_type="search_query", embedding_types=["float"])
        assert np.allclose(answer.embeddings.float_, queries, atol=1e-6)
        assert answer.meta.billed_units.input_tokens == prompt_tokens and answer.texts == TEXTS
        documents = client.embed(model=MODEL, texts=TEXTS, input_type="search_document",
                                 embedding_types=["float", "ubinary"])
        assert np.allclose(documents.embeddings.float_, passages, atol=1e-6)
        assert not np.allclose(documents.embeddings.float_, queries, atol=1e-3)  # the prefix reached the model
        bits = np.unpackbits(np.array(documents.embeddings.ubinary, dtype=np.uint8), axis=1)
        assert np.array_equal(bits.astype(bool), passages >= 0)
        with pytest.raises(cohere.BadRequestError, match="input_type"):  # a type the model defines no prompt for
            client.embed(model=MODEL, texts=TEXTS, input_type="clustering", embedding_types=["float"])
