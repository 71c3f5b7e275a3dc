"""The pooling routes probed as a careless client would: huge input arrays, out-of-range, negative and
boolean token ids, empty strings and lists, 100k-character inputs, every wrong ``dimensions``, a bad
``encoding_format``, mismatched score lists (under each of vLLM's field names), a negative or huge
``top_n``, Cohere's ``/v2/embed`` with embedding types, truncation and input types it cannot serve, and
each route on the model of the other task. Every answer is a 4xx OpenAI error object naming the field
(never a 500), refused before the engine does the work, and the server answers a good request
afterwards. The real server on all-MiniLM-L6-v2 and on the tiny Llama."""

from __future__ import annotations

import os

import pytest
import requests

from stage5_server import LLM
from stage5_server.config.model import resolve_model
from stage5_server.server import create_app
from tests.stage5.server_fixtures import auth, running_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
KEY = "test-key-pooling-probes"
MODEL = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def server():
    llm = LLM(resolve_model(MODEL), dtype="float32", max_num_seqs=8)
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    with running_server(app) as running:
        yield running.url, llm


@pytest.fixture(scope="module")
def generator(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64, num_kv_blocks=16, block_size=16)
    app = create_app(llm, api_keys=[KEY], served_model_name="tiny", log_stats_interval=None)
    with running_server(app) as running:
        yield running.url


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, headers=auth(KEY), timeout=120)


def client_error(response: requests.Response, param: str | None = None, words: str = "") -> dict:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    assert "Traceback" not in response.text
    if param is not None:
        assert error["param"].startswith(param), error  # a body's type error names the field's branch: input.str
    assert words in error["message"], error
    return error


def still_embeds(url: str) -> None:
    response = post(url, "/v1/embeddings", {"model": MODEL, "input": "hello"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("body, param, words", [
    ({"input": ["a"] * 100_000}, "input", "--max-prompts-per-request"),
    ({"input": [[1, 2]] * 5000}, "input", "--max-prompts-per-request"),
    ({"input": "x " * 100_000}, "input", "maximum context length"),
    ({"input": ["word"] * 3 + ["y " * 100_000]}, "input", "maximum context length"),
    ({"input": [-1]}, "input", "token ids must be in"),
    ({"input": [[5], [2 ** 63]]}, "input", "token ids must be in"),
    ({"input": [10 ** 30]}, "input", ""),
    ({"input": [True, False]}, "input", ""),
    ({"input": [1.5]}, "input", ""),
    ({"input": ""}, "input", "empty input"),
    ({"input": [""]}, "input", "empty input"),
    ({"input": [[]]}, "input", "empty input"),
    ({"input": []}, "input", "at least one input"),
    ({"input": None}, "input", ""),
    ({"input": "hi", "dimensions": 0}, "dimensions", ""),
    ({"input": "hi", "dimensions": -1}, "dimensions", ""),
    ({"input": "hi", "dimensions": 10 ** 9}, "dimensions", ""),
    ({"input": "hi", "dimensions": 384}, "dimensions", "matryoshka"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "hi", "encoding_format": None}, "encoding_format", ""),
    ({"input": "hi", "truncate_prompt_tokens": 10 ** 9}, "truncate_prompt_tokens", "max_model_len"),
    ({"input": "hi", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens", ""),
])
def test_bad_embedding_inputs_are_4xx_naming_the_field(server, body, param, words):
    url, _ = server
    client_error(post(url, "/v1/embeddings", {"model": MODEL, **body}), param, words)
    still_embeds(url)


@pytest.mark.slow
def test_long_inputs_that_fit_are_still_embedded(server):
    url, _ = server
    response = post(url, "/v1/embeddings", {"model": MODEL, "input": "word " * 20_000, "truncate_prompt_tokens": -1})
    assert response.status_code == 200, response.text
    unknown = post(url, "/v1/embeddings", {"model": MODEL, "input": ["y" * 100_000] * 3})  # one [UNK] token each
    assert unknown.status_code == 200, unknown.text
    full = post(url, "/v1/embeddings", {"model": MODEL, "input": ["hi"] * 256})  # exactly the cap
    assert full.status_code == 200 and len(full.json()["data"]) == 256
    cut = post(url, "/v2/embed", {"model": MODEL, "texts": ["z " * 100_000]})  # Cohere's default: cut at the end
    assert cut.status_code == 200 and cut.json()["meta"]["tokens"]["input_tokens"] == 256, cut.text
    pairs = post(url, "/v1/score", {"model": MODEL, "text_1": ["a"] * 256, "text_2": ["b"] * 256})
    assert pairs.status_code == 200 and len(pairs.json()["data"]) == 256  # 256 pairs: the cap counts pairs
    ranked = post(url, "/v1/rerank", {"model": MODEL, "query": "q", "documents": ["d"] * 256})
    assert ranked.status_code == 200 and len(ranked.json()["results"]) == 256  # and documents, not the query


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "cannot pair"),
    ("/v1/score", {"text_1": [], "text_2": []}, "text_1", ""),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2", "an empty list"),
    ("/v1/score", {"text_1": "", "text_2": "b"}, "text_1", "empty input"),
    ("/v1/score", {"text_1": "a", "text_2": ["b"] * 10_000}, "text_2", "--max-prompts-per-request"),
    ("/v1/score", {"text_1": "a", "text_2": "z " * 100_000}, "text_2", "maximum context length"),
    ("/score", {"text_1": "a", "text_2": 5}, "text_2", ""),
    ("/v1/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n", ""),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents", "at least one"),
    ("/v1/rerank", {"query": "", "documents": ["d"]}, "query", "empty input"),
    ("/v1/rerank", {"query": "q", "documents": ["d", ""]}, "documents", "empty input"),
    ("/v1/rerank", {"query": "q", "documents": ["d"] * 10_000}, "documents", "--max-prompts-per-request"),
    ("/rerank", {"query": "q " * 100_000, "documents": ["d"]}, "query", "maximum context length"),
    ("/v2/rerank", {"query": "q", "documents": "d"}, "documents", ""),
])
def test_bad_score_and_rerank_bodies_are_4xx_naming_the_field(server, path, body, param, words):
    url, _ = server
    client_error(post(url, path, {"model": MODEL, **body}), param, words)
    still_embeds(url)


@pytest.mark.parametrize("path, body, param, words", [
    ("/pooling", {"input": ["a"] * 100_000}, "input", "--max-prompts-per-request"),
    ("/pooling", {"input": "x " * 100_000}, "input", "maximum context length"),
    ("/pooling", {"input": ""}, "input", "empty input"),
    ("/pooling", {"input": "hi", "dimensions": 384}, "dimensions", "matryoshka"),
    ("/pooling", {"input": "hi", "task": "classify"}, "task", "only \"embed\""),
    ("/pooling", {"input": "hi", "use_activation": False}, "use_activation", ""),
    ("/pooling", {"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages", ""),
    ("/v2/embed", {"texts": ["a"] * 100_000}, "texts", "--max-prompts-per-request"),
    ("/v2/embed", {"texts": []}, "texts", "at least one input"),
    ("/v2/embed", {"texts": [""]}, "texts", "empty input"),
    ("/v2/embed", {"texts": ["z " * 100_000], "truncate": "NONE"}, "texts", "maximum context length"),
    ("/v2/embed", {"texts": ["z " * 300], "truncate": "NONE"}, "texts", "maximum context length"),
    ("/v2/embed", {"texts": ["one two three four"], "truncate": "NONE", "max_tokens": 3}, "texts[0]", "truncate"),
    ("/v2/embed", {"texts": ["hi"], "max_tokens": 10 ** 6}, "max_tokens", "max_model_len"),
    ("/v2/embed", {"texts": ["hi"], "max_tokens": 0}, "max_tokens", ""),
    ("/v2/embed", {"texts": ["hi"], "embedding_types": ["int8"]}, "embedding_types", "calibrated"),
    ("/v2/embed", {"texts": ["hi"], "embedding_types": []}, "embedding_types", ""),
    ("/v2/embed", {"texts": ["hi"], "input_type": "search_query"}, "input_type", "defines no input_type"),
    ("/v2/embed", {"texts": ["hi"], "output_dimension": 256}, "output_dimension", "matryoshka"),
    ("/v2/embed", {"texts": ["hi"], "truncate": "MIDDLE"}, "truncate", ""),
    ("/v2/embed", {"images": ["data:image/png;base64,AAAA"]}, "images", "read text"),
    ("/v2/embed", {}, "texts", ""),
    ("/v1/score", {"queries": "q"}, "documents", "Field required"),
    ("/v1/score", {"data_2": ["d"]}, "data_1", "Field required"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "queries": "q"}, "", "one pair"),
    ("/v1/score", {"queries": ["a", "b"], "documents": ["c", "d", "e"]}, "queries", "cannot pair"),
    ("/v1/score", {"data_1": "a", "data_2": []}, "data_2", "an empty list"),
    ("/v1/score", {"queries": "q", "items": ["d"] * 10_000}, "items", "--max-prompts-per-request"),
    ("/score", {}, "text_1", "Field required"),
])
def test_bad_bodies_of_vllms_newer_pooling_routes_are_4xx_naming_the_field(server, path, body, param, words):
    url, _ = server
    error = client_error(post(url, path, {"model": MODEL, **body}), param or None, words)
    if not param:
        assert error["message"], error
    still_embeds(url)


def test_a_huge_top_n_returns_every_document_ranked(server):
    url, _ = server
    response = post(url, "/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a", "b", "c"],
                                        "top_n": 10 ** 12})
    assert response.status_code == 200, response.text
    assert sorted(r["index"] for r in response.json()["results"]) == [0, 1, 2]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"}),
])
def test_generation_routes_on_the_pooling_model_name_its_task(server, path, body):
    url, _ = server
    error = client_error(post(url, path, {"model": MODEL, **body}))
    assert "does not support" in error["message"], error


@pytest.mark.parametrize("path, body, api", [
    ("/v1/embeddings", {"input": "hi"}, "Embeddings"),
    ("/v1/score", {"text_1": "a", "text_2": "b"}, "Score"),
    ("/score", {"text_1": "a", "text_2": "b"}, "Score"),
    ("/rerank", {"query": "q", "documents": ["d"]}, "Rerank"),
    ("/pooling", {"input": "hi"}, "Pooling"),
    ("/v2/embed", {"texts": ["hi"]}, "Embeddings"),
    ("/v1/score", {"queries": "q", "documents": ["d"]}, "Score"),
    ("/v1/embeddings", {"input": ["a"] * 100_000}, "Embeddings"),  # the task is refused before the count
])
def test_pooling_routes_on_a_generating_model_name_its_task(generator, path, body, api):
    error = client_error(post(generator, path, {"model": "tiny", **body}))
    assert f"does not support {api}" in error["message"], error
