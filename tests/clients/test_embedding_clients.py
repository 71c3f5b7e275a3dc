"""Real client libraries, unchanged, against a server of the embedding model (all-MiniLM-L6-v2): the openai
client's ``embeddings.create`` (it asks for base64 by default), langchain's ``OpenAIEmbeddings`` and
litellm's ``embedding``, each matching the offline vectors; and a small retrieval check through
``/v1/rerank``: the passage that answers each question is ranked first."""

from __future__ import annotations

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
def server(llm, expected):  # the offline vectors first: once serving, the server's thread drives the engine
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    with running_server(app) as running:
        yield running.url


@pytest.fixture(scope="module")
def expected(llm):
    return np.array([o.outputs.embedding for o in llm.embed(TEXTS)])


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
