"""Bad input gets the right 4xx and an OpenAI error object; engine failures and vanished
clients cost only their own requests; through all of it the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from stage5_server.server import create_app
from tests.stage5.server_fixtures import auth, fail_execute, make_llm, metric, running_server, sse_events, wait_until

KEY = "errors-key"
MODEL = "tiny"
MAX_BODY = 16 << 10
OK_CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tiny_llama):
    llm = make_llm(tiny_llama)
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, max_body_bytes=MAX_BODY, log_stats_interval=None)
    with running_server(app) as server:
        with httpx.Client(base_url=server.url, headers=auth(KEY), timeout=60) as client:
            yield {"llm": llm, "client": client}


@pytest.fixture
def client(served) -> httpx.Client:
    return served["client"]


def assert_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_still_serving(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json={"messages": OK_CHAT, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


LONG = "data point " * 200  # several hundred tokens: more than max_model_len=256
COMPLETION_CASES = [
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", None),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ({"prompt": "hi", "skip_special_tokens": False}, 400, "skip_special_tokens", None),  # vLLM's, not here
    ({"prompt": "hi", "guided_regex": "a+"}, 400, "guided_regex", None),  # removed from vLLM: a 400 says so
    ({"prompt": "hi", "n": 2, "temperature": 0}, 400, "n", None),  # n greedy copies: refused, as vLLM
    ({"prompt": "hi", "n": 0}, 400, "n", None),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of", None),
    ({"prompt": "hi", "echo": "yes"}, 400, "echo", None),
    ({"prompt": "hi", "max_tokens": 0, "echo": False}, 400, "max_tokens", None),  # 0 only to echo a scored prompt
    ({"prompt": "hi", "suffix": "tail"}, 400, "suffix", None),
    ({"prompt": "hi", "logit_bias": {"five": 10}}, 400, "logit_bias", None),
    ({"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty", None),
    ({"prompt": "hi", "frequency_penalty": "1"}, 400, "frequency_penalty", None),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ({"prompt": "hi", "top_k": -5}, 400, "top_k", None),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ({"prompt": "hi", "logprobs": 50}, 400, "logprobs", None),
    ({"prompt": "hi", "stop": [""]}, 400, "stop", None),
    ({"prompt": "hi", "seed": 1.5}, 400, "seed", None),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "x": 1}}, 400,
     "stream_options.x", None),
    ({"prompt": ""}, 400, "prompt", None),
    ({"prompt": [10**6]}, 400, "prompt", None),
    ({"prompt": ["one", 2]}, 400, "prompt", None),
    ({"prompt": [[1, 2], []]}, 400, "prompt", None),
    ({"prompt": 42}, 400, "prompt", None),
    ({}, 400, "prompt", None),
    ({"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    ({"prompt": "hi", "max_tokens": 300}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": "hi", "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ({"prompt": "hi", "cache_salt": "mine"}, 400, "cache_salt", None),
]
CHAT_CASES = [
    ({"messages": []}, 400, "messages", None),
    ({"messages": "hi"}, 400, "messages", None),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", None),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content", None),
    ({"messages": [{"role": "user", "content": "x", "name": 7}]}, 400, "messages[0].name", None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://10.0.0.1/x"}}]}]},
     400, "messages[0].content", None),
    ({"messages": OK_CHAT, "tools": [{"type": "function", "function": {"name": "f g"}}]}, 400,
     "tools[0].function.name", None),
    ({"messages": OK_CHAT, "tool_choice": "auto"}, 400, "tool_choice", None),
    ({"messages": OK_CHAT, "functions": [{"name": "f"}]}, 400, "functions", None),
    ({"messages": OK_CHAT, "response_format": {"type": "yaml"}}, 400, "response_format.type", None),
    ({"messages": OK_CHAT, "verbosity": "low"}, 400, "verbosity", None),  # would change the answer
    ({"messages": OK_CHAT, "allowed_token_ids": [1, 2]}, 400, "allowed_token_ids", None),  # vLLM's, not here
    ({"messages": [*OK_CHAT, {"role": "assistant", "content": "", "refusal": "I can't"}]}, 400,
     "messages[1].refusal", None),
    ({"messages": OK_CHAT, "n": 3, "temperature": 0}, 400, "n", None),
    ({"messages": OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs", None),
    ({"messages": OK_CHAT, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs", None),
    ({"messages": OK_CHAT, "max_completion_tokens": 300}, 400, "max_tokens", "context_length_exceeded"),
    ({"messages": OK_CHAT, "max_tokens": 3, "max_completion_tokens": 300}, 400, "max_tokens",
     "context_length_exceeded"),  # max_completion_tokens is the one taken
    ({"messages": [{"role": "user", "content": LONG}]}, 400, "messages", "context_length_exceeded"),
    ({"messages": OK_CHAT, "model": "nope"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("body,status,param,code", COMPLETION_CASES,
                         ids=[f"completions-{c[2]}-{i}" for i, c in enumerate(COMPLETION_CASES)])
def test_bad_completion_requests_get_an_error_naming_the_field(client, body, status, param, code):
    assert_error(client.post("/v1/completions", json=body), status, param, code)
    assert_still_serving(client)


@pytest.mark.parametrize("body,status,param,code", CHAT_CASES,
                         ids=[f"chat-{c[2]}-{i}" for i, c in enumerate(CHAT_CASES)])
def test_bad_chat_requests_get_an_error_naming_the_field(client, body, status, param, code):
    assert_error(client.post("/v1/chat/completions", json=body), status, param, code)
    assert_still_serving(client)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b'"a string"', b"\xff\xfe"])
def test_malformed_bodies_are_400(client, raw):
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(response, 400)
    assert_still_serving(client)


def test_harmless_defaults_the_openai_clients_may_send_are_accepted(client):
    body = {"model": MODEL, "messages": OK_CHAT, "max_tokens": 2, "n": 1, "presence_penalty": 0,
            "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"}, "user": "u-1",
            "stream": False, "logprobs": False, "tools": None, "tool_choice": "none", "parallel_tool_calls": False,
            "service_tier": "auto", "store": False}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_an_unsupported_value_is_named_with_the_accepted_ones_in_json(client):
    response = client.post("/v1/chat/completions", json={"messages": OK_CHAT, "modalities": ["text", "audio"]})
    message = assert_error(response, 400, "modalities")["message"]
    assert message == 'modalities is not supported by this server (only ["text"] or null)'


def test_tokenize_and_detokenize_validate_their_input(client):
    assert_error(client.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    assert_error(client.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")
    assert_error(client.post("/tokenize", json={}), 400, "prompt")
    assert_error(client.post("/tokenize", json={"prompt": "x", "model": "other"}), 404, "model", "model_not_found")
    assert_still_serving(client)


def test_wrong_methods_and_paths_get_error_objects(client):
    assert_error(client.get("/v1/completions"), 405, code="method_not_allowed")
    assert_error(client.post("/v1/models"), 405)
    assert_error(client.get("/v2/nothing"), 404, code="not_found")
    assert_error(client.get("/v1/models/some-other-model"), 404, "model", "model_not_found")


def test_a_body_over_the_limit_is_413_by_length_or_when_streamed(client):
    big = json.dumps({"prompt": "x" * (MAX_BODY + 10)}).encode()
    assert_error(client.post("/v1/completions", content=big, headers={"content-type": "application/json"}),
                 413, code="request_too_large")

    def chunks():  # no Content-Length: chunked transfer encoding
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    assert_error(client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}),
                 413, code="request_too_large")
    assert_still_serving(client)


def kv_usage(client: httpx.Client) -> tuple[float, float]:
    text = client.get("/metrics").text
    return metric(text, "vllm:kv_cache_usage_perc"), metric(text, "vllm:num_requests_running")


def test_an_engine_failure_is_a_500_and_the_next_request_succeeds(client, served, monkeypatch):
    state = fail_execute(monkeypatch, served["llm"], on_call=1, times=1)
    body = {"messages": OK_CHAT, "max_tokens": 4}
    error = assert_error(client.post("/v1/chat/completions", json=body), 500, code="engine_error")
    assert "Traceback" not in error["message"]
    assert state["failures"] == 1
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert wait_until(lambda: kv_usage(client) == (0.0, 0.0))


def test_an_engine_failure_before_the_first_token_of_a_stream_is_a_500(client, served, monkeypatch):
    fail_execute(monkeypatch, served["llm"], on_call=1, times=1)
    body = {"prompt": "stream me", "max_tokens": 4, "stream": True}
    assert_error(client.post("/v1/completions", json=body), 500, code="engine_error")
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])


def test_an_engine_failure_mid_stream_ends_the_stream_with_an_error_event(client, served, monkeypatch):
    fail_execute(monkeypatch, served["llm"], on_call=4, times=1)  # prefill and two decodes succeed
    body = {"prompt": "stream me further", "max_tokens": 20, "stream": True, "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_error"
    assert any("choices" in e for e in events[:-2])  # tokens had been streamed before the failure
    assert_still_serving(client)
    assert wait_until(lambda: kv_usage(client) == (0.0, 0.0))


@pytest.mark.slow
def test_clients_that_disconnect_mid_stream_give_their_kv_back(client, served):
    aborted_before = metric(client.get("/metrics").text, "vllm:request_success_total", finished_reason="abort") or 0
    body = {"prompt": "a long answer please", "max_tokens": 200, "stream": True, "ignore_eos": True}
    streams = []
    for i in range(8):
        context = client.stream("POST", "/v1/completions", json={**body, "prompt": f"{i} {body['prompt']}"})
        response = context.__enter__()
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")  # it is generating
        streams.append(context)
    usage, running = kv_usage(client)
    assert usage > 0 and running > 0
    for context in streams:
        context.__exit__(None, None, None)  # close the connection mid-stream
    assert wait_until(lambda: kv_usage(client) == (0.0, 0.0)), kv_usage(client)
    aborted = metric(client.get("/metrics").text, "vllm:request_success_total", finished_reason="abort")
    assert aborted - aborted_before == 8
    assert_still_serving(client)


def test_a_client_that_leaves_a_non_streaming_request_aborts_it(client, served):
    def aborted() -> float:
        return metric(client.get("/metrics").text, "vllm:request_success_total", finished_reason="abort") or 0

    before = aborted()
    body = {"prompt": "slow and long", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{str(client.base_url).rstrip('/')}/v1/completions", json=body, headers=auth(KEY),
                   timeout=httpx.Timeout(30, read=0.05))
    assert wait_until(lambda: kv_usage(client) == (0.0, 0.0)), kv_usage(client)
    assert aborted() == before + 1
    assert_still_serving(client)
