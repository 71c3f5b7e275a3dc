"""The security boundary: an API key on every route but /health, trust groups that set the
prefix-cache salt, client cache salts refused unless the server trusts them, limits on body
size and prompt length, and errors and logs that carry no stack trace or key material."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from stage5_server.engine import AsyncLLM
from stage5_server.server import create_app
from stage5_server.server.auth import (
    RECEIVED_SCOPE_KEY,
    TRUST_GROUP_SCOPE_KEY,
    APIKeyMiddleware,
    APIKeys,
    CacheSalter,
)
from tests.reliability.figures import count
from tests.stage5.server_fixtures import EngineCallRecorder, auth, fail_execute, make_llm, metric, running_server

KEYS = {"alice-key": "teamA", "alan-key": "teamA", "bob-key": "teamB"}
MODEL = "tiny"
MAX_BODY = 64 << 10


@pytest.fixture(scope="module")
def servers(tiny_llama):
    llm = make_llm(tiny_llama)
    recorder = EngineCallRecorder(llm)
    engine = AsyncLLM.from_llm(llm, log_stats_interval=None)
    strict = create_app(engine, api_keys=KEYS, served_model_name=MODEL, max_body_bytes=MAX_BODY)
    trusting = create_app(engine, api_keys=KEYS, served_model_name=MODEL, trust_client_cache_salt=True,
                          metrics_public=True)
    try:
        with running_server(strict) as s1, running_server(trusting) as s2:
            yield {"strict": (strict, s1.url), "trusting": (trusting, s2.url), "recorder": recorder,
                   "engine": engine, "llm": llm}
    finally:
        engine.shutdown()
        recorder.restore()


def _requests_for(route) -> list[tuple[str, str]]:
    path = re.sub(r"\{[^}]+\}", "x", route.path)  # fill path parameters
    return [(method, path) for method in sorted(route.methods or ["GET"])]


def test_every_route_but_health_refuses_a_missing_or_wrong_key(servers):
    app, url = servers["strict"]
    checked = 0
    with httpx.Client(base_url=url, timeout=30) as client:
        for route in app.routes:
            for method, path in _requests_for(route):
                for headers in ({}, auth("wrong-key"), {"Authorization": "Basic alice-key"}):
                    response = client.request(method, path, headers=headers, json={})
                    if path == "/health":
                        assert response.status_code == 200
                        continue
                    assert response.status_code == 401, (method, path, headers)
                    if method != "HEAD":
                        assert response.json()["error"]["code"] == "invalid_api_key"
                    assert response.headers["www-authenticate"] == "Bearer"
                checked += 1
    paths = {r.path for r in app.routes}
    assert {"/docs", "/redoc", "/openapi.json", "/metrics", "/v1/completions", "/v1/chat/completions",
            "/v1/models", "/tokenize", "/detokenize", "/version", "/v1/embeddings", "/v1/score", "/score",
            "/v1/rerank", "/rerank", "/v2/rerank", "/pooling", "/v2/embed", "/v1/responses"} <= paths
    assert checked >= len(paths)


def test_a_valid_key_opens_the_docs_and_the_api(servers):
    _, url = servers["strict"]
    with httpx.Client(base_url=url, headers=auth("bob-key"), timeout=30) as client:
        assert client.get("/docs").status_code == 200
        assert client.get("/openapi.json").json()["info"]["title"] == "stagedserve"
        assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
        assert client.get("/metrics").status_code == 200


def test_unknown_paths_answer_401_without_a_key_and_404_with_one(servers):
    _, url = servers["strict"]
    assert httpx.get(f"{url}/v1/audio/speech").status_code == 401  # a route this server lacks
    response = httpx.get(f"{url}/v1/audio/speech", headers=auth("alice-key"))
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert httpx.post(f"{url}/score", json={}).status_code == 401  # vLLM's unprefixed alias, keyed here


def test_a_route_added_after_create_app_is_protected_too(servers):
    app, url = servers["strict"]
    app.add_api_route("/late-admin", lambda: {"secret": True}, methods=["GET"])
    assert httpx.get(f"{url}/late-admin").status_code == 401
    assert httpx.get(f"{url}/late-admin", headers=auth("alice-key")).json() == {"secret": True}


def test_metrics_can_be_made_public_health_always_is(servers):
    _, strict_url = servers["strict"]
    _, public_url = servers["trusting"]
    assert httpx.get(f"{strict_url}/metrics").status_code == 401
    response = httpx.get(f"{public_url}/metrics")
    assert response.status_code == 200 and metric(response.text, "vllm:kv_cache_usage_perc") is not None
    assert httpx.get(f"{public_url}/v1/models").status_code == 401  # only /metrics became public
    assert httpx.get(f"{strict_url}/health").status_code == 200


def _complete(url: str, key: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": "The shared system prompt", "max_tokens": 2, "temperature": 0, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, headers=auth(key), timeout=30)


def _salt_of(servers, response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return servers["recorder"].salts[response.json()["id"]]


def test_keys_in_one_trust_group_share_a_salt_and_groups_differ(servers):
    _, url = servers["strict"]
    alice = _salt_of(servers, _complete(url, "alice-key"))
    alan = _salt_of(servers, _complete(url, "alan-key"))
    bob = _salt_of(servers, _complete(url, "bob-key"))
    assert alice == alan
    assert alice != bob
    for salt in (alice, bob):  # unguessable: a 256-bit HMAC, not the group's name
        assert re.fullmatch(r"[0-9a-f]{64}", salt)
    assert _salt_of(servers, _complete(url, "alice-key")) == alice  # stable for the server's lifetime


def test_client_cache_salt_is_refused_unless_the_server_trusts_it(servers):
    _, strict_url = servers["strict"]
    _, trusting_url = servers["trusting"]
    refused = _complete(strict_url, "alice-key", cache_salt="my-salt")
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "cache_salt"

    group_salt = _salt_of(servers, _complete(trusting_url, "alice-key"))
    mine = _salt_of(servers, _complete(trusting_url, "alice-key", cache_salt="my-salt"))
    mine_again = _salt_of(servers, _complete(trusting_url, "alan-key", cache_salt="my-salt"))
    other = _salt_of(servers, _complete(trusting_url, "alice-key", cache_salt="other-salt"))
    bob_same_salt = _salt_of(servers, _complete(trusting_url, "bob-key", cache_salt="my-salt"))
    assert mine == mine_again  # same group, same client salt: shared
    assert len({group_salt, mine, other, bob_same_salt}) == 4  # a client salt never reaches another group


def test_every_engine_call_runs_on_the_engine_thread(servers):
    _complete(servers["strict"][1], "alice-key")
    assert servers["recorder"].threads == {"stagedserve-engine"}


def test_a_server_without_keys_is_open_but_still_salts_by_its_one_group(tiny_llama):
    llm = make_llm(tiny_llama, num_kv_blocks=32)
    recorder = EngineCallRecorder(llm)
    app = create_app(llm, served_model_name=MODEL, log_stats_interval=None)
    with running_server(app) as server:
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
        assert response.status_code == 200
        assert re.fullmatch(r"[0-9a-f]{64}", recorder.salts[response.json()["id"]])


def test_api_keys_compare_every_key_and_reject_bad_configurations():
    keys = APIKeys({"k1": "g", "k2": "g", "k3": None})
    assert keys.authenticate("k1") == keys.authenticate("k2") == "g"
    assert keys.authenticate("k3") == "key#3"  # a key without a group is a group of its own
    assert keys.authenticate("k4") is None and keys.authenticate(None) is None
    assert keys.authenticate("k1 ") is None
    for bad in ([], {"": "g"}, {"has space": "g"}, {"k": "bad group!"}, ["k", "k"]):
        with pytest.raises(ValueError, match="api_keys"):
            APIKeys(bad)


def test_the_key_middleware_answers_401_itself_and_passes_a_valid_key_on_with_its_group():
    seen = []

    async def app(scope, receive, send):  # what the middleware protects: records who got through
        seen.append((scope["type"], scope.get(TRUST_GROUP_SCOPE_KEY), RECEIVED_SCOPE_KEY in scope))
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})

    middleware = APIKeyMiddleware(app, APIKeys({"k1": "teamA"}), frozenset({"/health"}))

    def call(path: str, headers: list[tuple[bytes, bytes]], kind: str = "http") -> list[dict]:
        sent = []

        async def send(message):
            sent.append(message)

        asyncio.run(middleware({"type": kind, "path": path, "headers": headers}, None, send))
        return sent

    refused = call("/v1/models", [])
    assert refused[0]["status"] == 401 and (b"www-authenticate", b"Bearer") in refused[0]["headers"]
    assert call("/v1/models", [(b"authorization", b"Bearer wrong")])[0]["status"] == 401
    assert call("/nowhere", [(b"authorization", b"Basic k1")])[0]["status"] == 401
    assert call("/websocket", [], kind="websocket") == [{"type": "websocket.close", "code": 1008}]
    assert seen == []
    assert call("/v1/models", [(b"authorization", b"Bearer k1")])[0]["status"] == 200
    assert call("/health", [])[0]["status"] == 200  # public: passes without a key, with no group
    call("", [], kind="lifespan")
    assert seen == [("http", "teamA", True), ("http", None, True), ("lifespan", None, False)]


def test_cache_salts_depend_on_the_server_secret():
    a, b = CacheSalter(), CacheSalter()
    assert a.salt("teamA") != b.salt("teamA")
    assert CacheSalter(b"s" * 32).salt("teamA") == CacheSalter(b"s" * 32).salt("teamA")
    assert a.salt("teamA", "x") != a.salt("teamA") != a.salt("teamB")



def test_only_keys_in_one_trust_group_share_prefix_cache_blocks(servers):
    """The same long prompt: a hit for a key in the first sender's group, none for another group."""
    _, url = servers["strict"]
    prompt = "Prompts that start the same way share their cached blocks: a system prompt is computed once. " * 2

    def hits_after(key: str) -> float:
        response = httpx.post(f"{url}/v1/completions", headers=auth(key), timeout=60,
                              json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert response.status_code == 200, response.text
        text = httpx.get(f"{url}/metrics", headers=auth(key), timeout=10).text
        return metric(text, "vllm:prefix_cache_hits_total")

    before = hits_after("alice-key")  # teamA computes the prompt (maybe hitting its own earlier blocks)
    after_bob = hits_after("bob-key")  # teamB: the same tokens under another salt
    assert after_bob == before
    after_alan = hits_after("alan-key")  # teamA again, through another key of the group
    assert after_alan > after_bob


def test_the_key_is_checked_before_the_body_is_read_and_the_body_is_capped(servers):
    _, url = servers["strict"]
    huge = {"model": MODEL, "prompt": "x" * (MAX_BODY + 1)}
    anonymous = httpx.post(f"{url}/v1/completions", json=huge, timeout=30)
    assert anonymous.status_code == 401  # an anonymous client cannot make the server read (or parse) a big body
    capped = httpx.post(f"{url}/v1/completions", json=huge, headers=auth("alice-key"), timeout=30)
    assert capped.status_code == 413 and capped.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "word " * 300}, "prompt"),
    ("/v1/completions", {"prompt": list(range(1, 300))}, "prompt"),
    ("/v1/completions", {"prompt": list(range(1, 257))}, "prompt"),  # exactly max_model_len: no room left
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 300}]}, "messages"),
    ("/v1/completions", {"prompt": "short", "max_tokens": 300}, "max_tokens"),
])
def test_prompts_longer_than_the_context_are_refused_before_they_reach_the_engine(servers, route, body, param):
    _, url = servers["strict"]
    engine = servers["engine"]
    response = httpx.post(f"{url}{route}", json={"model": MODEL, **body}, headers=auth("alice-key"), timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "context_length_exceeded")
    assert engine.stats.num_waiting == engine.stats.num_running == 0


SECRETS = ["alice-key", "alan-key", "bob-key", "guessed-key-12345"]


def test_errors_and_logs_carry_no_stack_trace_or_key_material(servers, monkeypatch, caplog):
    """Every kind of error, the server's logger at DEBUG: no traceback in a body, no key or salt anywhere."""
    _, url = servers["strict"]
    recorder = servers["recorder"]
    bodies = []
    with caplog.at_level("DEBUG"), httpx.Client(base_url=url, timeout=30) as client:
        def post(path, key, **kwargs):
            response = client.post(path, headers=auth(key), **kwargs)
            bodies.append(response)
            return response

        post("/v1/completions", "guessed-key-12345", json={"prompt": "hi"})  # a wrong key
        client.get("/metrics", headers={"Authorization": "Basic alice-key"})
        post("/v1/completions", "alice-key", json={"prompt": "alice-key", "max_tokens": "x"})  # a key in the body
        post("/v1/completions", "alice-key", content=b"{not json alice-key")
        post("/v1/completions", "alice-key", json={"prompt": "hi", "cache_salt": "bob-key"})
        post("/v1/nothing-here", "alice-key")
        ok = post("/v1/completions", "alice-key", json={"model": MODEL, "prompt": "remember me", "max_tokens": 2})
        assert ok.status_code == 200
        fail_execute(monkeypatch, servers["llm"], on_call=1, times=1)
        failed = post("/v1/completions", "alice-key", json={"model": MODEL, "prompt": "fail me", "max_tokens": 2})
        assert failed.status_code == 500
    salts = set(recorder.salts.values()) - {None}
    assert salts
    for response in bodies:
        text = response.text
        assert "Traceback" not in text and 'File "' not in text, text
        assert not any(salt in text for salt in salts)
        assert not any(key in text for key in SECRETS if key not in response.request.content.decode(errors="replace"))
        if response.status_code >= 400:
            assert set(response.json()) == {"error"}
    server_records = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]  # not the client's
    handler = caplog.handler
    logged = "\n".join(handler.format(r) for r in server_records)  # tracebacks included
    assert "injected engine failure" in logged and "Traceback" in logged  # the operator gets the stack...
    for secret in [*SECRETS, *salts]:
        assert secret not in logged, f"{secret!r} appears in the logs"  # ...but no key or salt was
    count("security", "error_bodies_checked", len(bodies))
    count("security", "log_records_checked", len(server_records))
