"""A top-level field a route does not define: ignored as vLLM ignores it, named in the server's log and in
the ``X-Stagedserve-Ignored-Fields`` header (so a client that passes its own extras to several servers works
here too, and can see what was ignored); one of vLLM's own fields that this server lacks is a 400 unless its
value changes nothing; a field inside an object is still a 400; and ``--strict-request-fields`` keeps
OpenAI's 400 for every undefined field."""

from __future__ import annotations

import logging

import httpx
import pytest
from openai import OpenAI

from stage5_server.server import create_app
from tests.stage5.server_fixtures import auth, make_llm, running_server

KEY = "test-key-request-fields"
MODEL = "tiny-llama"
HEADER = "x-stagedserve-ignored-fields"
CHAT = [{"role": "user", "content": "Hello, world!"}]
BODIES = {"/v1/chat/completions": {"messages": CHAT, "max_tokens": 4, "temperature": 0},
          "/v1/completions": {"prompt": "Hello, world!", "max_tokens": 4, "temperature": 0},
          "/v1/responses": {"input": "Hello, world!", "max_output_tokens": 4, "temperature": 0},
          "/tokenize": {"prompt": "Hello, world!"}, "/detokenize": {"tokens": [1, 2, 3]},
          "/v1/embeddings": {"input": "Hello"}}  # a generating model: a 400, still naming what it ignored


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama)


@pytest.fixture(scope="module")
def url(llm):
    with running_server(create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)) as server:
        yield server.url


@pytest.fixture
def http(url) -> httpx.Client:
    with httpx.Client(base_url=url, headers=auth(KEY), timeout=60) as client:
        yield client


def test_the_openai_clients_extra_body_fields_are_ignored_and_named_in_a_header(url):
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, extra_body={"foo_unknown_field": 1, "my_vendor": {}})
    assert raw.headers[HEADER] == "foo_unknown_field, my_vendor"
    assert raw.parse().choices[0].message.content == plain.choices[0].message.content
    assert HEADER not in client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=1).headers
    streamed = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True,
                                                           extra_body={"foo_unknown_field": 1})
    assert streamed.headers[HEADER] == "foo_unknown_field"
    assert "".join(c.choices[0].text for c in streamed.parse() if c.choices)


@pytest.mark.parametrize("path", list(BODIES))
def test_every_vllm_route_ignores_an_unknown_field_and_says_so(http, path, caplog):
    with caplog.at_level(logging.INFO, logger="stagedserve"):
        response = http.post(path, json={**BODIES[path], "model": MODEL, "foo_unknown_field": 1})
    assert response.status_code == (400 if path == "/v1/embeddings" else 200), response.text
    assert response.headers[HEADER] == "foo_unknown_field"
    assert f"{path}: request fields ignored (this server and vLLM define none of them): foo_unknown_field" \
        in caplog.text


def test_vllms_own_fields_are_accepted_only_with_a_value_that_changes_nothing(http):
    body = {**BODIES["/v1/chat/completions"], "model": MODEL}
    harmless = http.post("/v1/chat/completions", json={**body, "skip_special_tokens": True, "priority": 0,
                                                         "add_generation_prompt": True, "echo": False})
    assert harmless.status_code == 200 and HEADER not in harmless.headers  # vLLM's defaults: what happens here
    for field, value, words in (("skip_special_tokens", False, "only true or null"), ("priority", 3, "only 0 or null"),
                                ("allowed_token_ids", [1], "only null"), ("prompt_logprobs", 1, "only null"),
                                ("guided_json", {"type": "object"}, "send structured_outputs")):
        response = http.post("/v1/chat/completions", json={**body, field: value, "foo_unknown_field": 1})
        assert response.status_code == 400, (field, response.text)
        error = response.json()["error"]
        assert error["param"] == field and words in error["message"], error


def test_a_field_inside_an_object_is_still_refused_and_the_header_comes_with_the_error(http):
    body = {**BODIES["/v1/chat/completions"], "model": MODEL, "foo_unknown_field": 1}
    nested = http.post("/v1/chat/completions", json={**body, "messages": [{**CHAT[0], "x": 1}]})
    assert nested.status_code == 400 and nested.json()["error"]["param"] == "messages[0].x"
    assert nested.headers[HEADER] == "foo_unknown_field"
    options = http.post("/v1/completions", json={**BODIES["/v1/completions"], "stream": True,
                                                  "stream_options": {"include_usage": True, "x": 1}})
    assert options.status_code == 400 and options.json()["error"]["param"] == "stream_options.x"


def test_odd_field_names_reach_the_header_quoted_and_cut_short(http):
    odd = {"line\nbreak": 1, "é" * 300: 2, **{f"f{i}": i for i in range(40)}}
    response = http.post("/tokenize", json={"prompt": "Hi", **odd})
    assert response.status_code == 200
    header = response.headers[HEADER]
    assert header.startswith('"line\\nbreak", "\\u00e9') and header.endswith(", and 10 more")
    assert len(header) < 1000 and header.isascii()


def test_strict_request_fields_answers_every_undefined_field_with_a_400(llm):
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None,
                     strict_request_fields=True)
    with running_server(app) as server, httpx.Client(base_url=server.url, headers=auth(KEY), timeout=60) as http:
        for path in ("/v1/chat/completions", "/tokenize"):
            response = http.post(path, json={**BODIES[path], "foo_unknown_field": 1})
            assert response.status_code == 400 and HEADER not in response.headers
            assert response.json()["error"] == {"message": "Unrecognized request argument supplied: foo_unknown_field",
                                                "type": "invalid_request_error", "param": "foo_unknown_field",
                                                "code": None}
        harmless = http.post("/v1/chat/completions", json={**BODIES["/v1/chat/completions"],
                                                           "skip_special_tokens": True})
        assert harmless.status_code == 400 and harmless.json()["error"]["param"] == "skip_special_tokens"
        schema = http.get("/openapi.json").json()["components"]["schemas"]
        assert schema["ChatCompletionRequest"]["additionalProperties"] is False


def test_the_schema_allows_additional_properties_where_the_server_ignores_them(http):
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "EmbeddingRequest",
                 "TokenizeRequest"):
        assert "additionalProperties" not in schemas[name], name
    assert schemas["ChatMessage"]["additionalProperties"] is False  # inside an object: still strict
