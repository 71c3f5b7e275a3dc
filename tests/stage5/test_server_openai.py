"""The server speaks the OpenAI API: the official client (sync and async, streaming or not),
raw SSE framing, and greedy outputs identical to the offline ``LLM`` on the same prompts."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from shared import SamplingParams
from stage5_server.server import create_app
from tests.stage5.server_fixtures import auth, make_llm, metric, running_server, sse_events

KEY = "test-key-openai"
MODEL = "tiny-llama"
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
PROMPTS = [f"Request {i}: the scheduler" + " runs" * (i % 5) for i in range(32)]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def served(tiny_llama):
    llm = make_llm(tiny_llama)
    # The offline references, computed before the engine thread owns the LLM.
    references = {p: o.outputs[0] for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY, use_tqdm=False))}
    chat_reference = llm.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0]
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    with running_server(app) as server:
        yield {"url": server.url, "app": app, "refs": references, "chat_ref": chat_reference}


@pytest.fixture
def client(served) -> OpenAI:
    with OpenAI(base_url=f"{served['url']}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def http(served) -> httpx.Client:
    with httpx.Client(base_url=served["url"], headers=auth(KEY), timeout=60) as c:
        yield c


def test_models_lists_and_retrieves_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    card = models.data[0].model_dump()
    assert card["root"] and card["parent"] is None  # vLLM's bench finds the tokenizer through root
    assert card["permission"][0]["object"] == "model_permission"


def test_completion_matches_offline_greedy_output(client, served):
    prompt = PROMPTS[3]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    choice = response.choices[0]
    ref = served["refs"][prompt]
    assert choice.text == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert response.usage.completion_tokens == len(ref.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert response.object == "text_completion" and response.model == MODEL


def test_completion_accepts_token_ids_as_the_prompt(client, http, served):
    prompt = PROMPTS[4]
    ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert response.choices[0].text == served["refs"][prompt].text
    assert response.usage.prompt_tokens == len(ids)


def test_chat_completion_applies_the_chat_template_and_matches_offline_chat(client, http, served):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=MAX_TOKENS,
                                              temperature=0)
    message = response.choices[0].message
    assert message.role == "assistant"
    assert message.content == served["chat_ref"].text
    assert response.choices[0].finish_reason == served["chat_ref"].finish_reason
    counted = http.post("/tokenize", json={"messages": CHAT}).json()["count"]
    assert response.usage.prompt_tokens == counted


def test_streaming_chat_with_the_sync_client_reassembles_the_same_text(client, served):
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    chunks = list(stream)
    first = chunks[0].choices[0]
    assert (first.delta.role, first.delta.content, first.finish_reason) == ("assistant", "", None)
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)  # the role is said once
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == served["chat_ref"].text
    assert chunks[-1].choices[0].finish_reason == served["chat_ref"].finish_reason


def test_a_chat_stream_starts_with_a_role_only_chunk_per_choice_as_openai_and_vllm_do(http):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 5, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = [e for e in sse_events(http.post("/v1/chat/completions", json=body).text.splitlines()) if e != "[DONE]"]
    prompt_tokens = http.post("/tokenize", json={"messages": CHAT}).json()["count"]
    for index in (0, 1):
        first = next(c for c in chunks if c["choices"] and c["choices"][0]["index"] == index)
        assert first["choices"][0] == {"index": index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None, "stop_reason": None}
        usage = first["usage"]  # continuous usage: the prompt, nothing generated yet
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (prompt_tokens, 0,
                                                                                               prompt_tokens)
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]  # both roles before any token
    assert sum("role" in c["choices"][0]["delta"] for c in chunks if c["choices"]) == 2


def test_async_client_streams_completions_and_chat_with_usage(served):
    async def run():
        async with AsyncOpenAI(base_url=f"{served['url']}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            stream = await c.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
            completion_chunks = [chunk async for chunk in stream]
            chat = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS,
                                                   temperature=0)
            return completion_chunks, chat

    chunks, chat = asyncio.run(run())
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ref = served["refs"][PROMPTS[5]]
    assert text == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chat.choices[0].message.content == served["chat_ref"].text


def test_sse_framing_is_data_lines_then_done(http, served):
    body = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    assert all(block.startswith("data: ") for block in raw.strip().split("\n\n"))
    events = sse_events(raw.splitlines())
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == served["refs"][PROMPTS[6]].finish_reason
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
    assert len({c["id"] for c in events[:-1]}) == 1


def test_stop_string_ends_the_text_before_it_streaming_or_not(client, served):
    prompt = PROMPTS[7]
    ref = served["refs"][prompt].text
    stop = ref[4:7]  # a stop string we know appears
    cut = ref[:ref.index(stop)]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         stop=[stop])
    assert response.choices[0].text == cut
    assert response.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in stream) == cut


def test_max_tokens_caps_the_output_with_finish_reason_length(client):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[8], max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 3
    assert response.choices[0].finish_reason == "length"


def test_seeded_sampling_repeats_and_top_k_top_p_are_accepted(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPTS[9], max_tokens=8, temperature=1.0, top_p=0.9,
                                         seed=seed, extra_body={"top_k": 20}).choices[0].text

    assert sample(7) == sample(7)


def test_completion_logprobs_have_one_entry_per_token(client):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[10], max_tokens=5, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    n = response.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == n
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs)  # the top 2, plus the sampled token
    assert "".join(logprobs.tokens) == response.choices[0].text or n == 5


def test_chat_logprobs_with_top_logprobs(client):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)  # greedy takes the top token
        assert bytes(entry.bytes).decode(errors="replace") == entry.token


def test_tokens_a_grammar_masks_out_get_vllms_floor_logprob_in_valid_json(client, http):
    # Under a grammar most of the vocabulary is masked to -inf; JSON has no infinity, so those
    # logprobs go out as -9999.0, as vLLM sends them (a 500 before).
    grammar = {"structured_outputs": {"choice": ["yes", "no"]}}
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[10], max_tokens=4, temperature=0, logprobs=5,
                                           extra_body=grammar)
    logprobs = completion.choices[0].logprobs
    assert completion.choices[0].text in ("yes", "no")
    assert all(-9999.0 < lp <= 0 for lp in logprobs.token_logprobs)  # a sampled token was never masked
    assert -9999.0 in logprobs.top_logprobs[0].values()
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=5, extra_body=grammar)
    first = chat.choices[0].logprobs.content[0]
    assert first.logprob > -9999.0 and -9999.0 in [t.logprob for t in first.top_logprobs]
    streamed = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[10], "max_tokens": 4,
                                                  "logprobs": 5, "stream": True, **grammar})
    assert streamed.status_code == 200 and "Infinity" not in streamed.text and "data: [DONE]" in streamed.text


def test_tokenize_and_detokenize_round_trip(http):
    tokens = http.post("/tokenize", json={"prompt": "Hello, world!"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello, world!"}


def test_health_and_version(served, http):
    assert httpx.get(f"{served['url']}/health").status_code == 200  # no key needed
    assert http.get("/version").json()["version"]


@pytest.mark.slow
def test_32_concurrent_streaming_clients_get_their_offline_greedy_outputs(served):
    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[str, str | None]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        text, finish = "", None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                for event in sse_events([line]):
                    if event != "[DONE]":
                        text += event["choices"][0]["text"]
                        finish = event["choices"][0]["finish_reason"] or finish
        return text, finish

    async def run():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=served["url"], headers=auth(KEY), timeout=120, limits=limits) as c:
            return await asyncio.gather(*[one(c, p) for p in PROMPTS])

    results = asyncio.run(run())
    for prompt, (text, finish) in zip(PROMPTS, results):
        ref = served["refs"][prompt]
        assert (text, finish) == (ref.text, ref.finish_reason), prompt


def test_metrics_use_vllm_names_with_the_model_label(http):
    http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
    text = http.get("/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"]:
        assert metric(text, name, model_name=MODEL) is not None, name
    for name in ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:time_per_output_token_seconds"]:
        assert metric(text, f"{name}_count", model_name=MODEL) > 0, name
    assert metric(text, "vllm:request_success_total", model_name=MODEL, finished_reason="length") > 0
