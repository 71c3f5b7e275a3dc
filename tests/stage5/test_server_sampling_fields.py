"""The sampling fields vLLM's server takes reach the engine: through the official OpenAI client
(``extra_body`` for vLLM's own), served outputs equal the offline ``LLM``'s with the same
``SamplingParams``; the chat details (developer role, ``name``, text parts, both token limits)
and ``stream_options.continuous_usage_stats`` behave as in vLLM."""

from __future__ import annotations

import logging

import httpx
import pytest
from openai import OpenAI

from shared import SamplingParams
from stage5_server.server import create_app
from stage5_server.server.protocol import log_ignored
from tests.stage5.server_fixtures import auth, make_llm, running_server, sse_events

KEY = "test-key-sampling"
MODEL = "tiny-llama"
PROMPT = "A scheduler spends one token budget per step"
CHAT = [{"role": "developer", "content": "Be brief.", "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "Add 4"}, {"type": "text", "text": "and 5."}]}]
# Each case: the request's extra fields, and the SamplingParams the offline reference uses.
CASES = {
    "penalties": ({"presence_penalty": -2, "frequency_penalty": -0.5, "repetition_penalty": 0.5},
                  dict(presence_penalty=-2.0, frequency_penalty=-0.5, repetition_penalty=0.5)),
    "logit_bias": ({"logit_bias": {"7": 100, "9": 250}}, dict(logit_bias={7: 100.0, 9: 100.0})),  # clamped
    "min_tokens": ({"min_tokens": 10, "stop_token_ids": [7], "logit_bias": {"7": 30}},
                   dict(min_tokens=10, stop_token_ids=[7], logit_bias={7: 30.0})),
    "sampled min_p": ({"temperature": 1.0, "seed": 3, "min_p": 0.2, "top_k": 30},
                      dict(temperature=1.0, seed=3, min_p=0.2, top_k=30)),
}


@pytest.fixture(scope="module")
def served(tiny_llama):
    llm = make_llm(tiny_llama)
    refs = {}
    for name, (_, params) in CASES.items():
        full = {"temperature": 0, "max_tokens": 12, **params}
        refs[name] = llm.generate(PROMPT, SamplingParams(**full), use_tqdm=False)[0].outputs[0]
    chat_params = SamplingParams(temperature=0, max_tokens=3)
    conversation = [{"role": "developer", "content": "Be brief.", "name": "ops"},
                    {"role": "user", "content": "Add 4\nand 5."}]
    refs["chat"] = llm.chat(conversation, chat_params, use_tqdm=False)[0]
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    with running_server(app) as server:
        yield server.url, refs


@pytest.fixture
def client(served) -> OpenAI:
    with OpenAI(base_url=f"{served[0]}/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.mark.parametrize("case", list(CASES))
def test_served_sampling_fields_give_the_offline_output(client, served, case):
    extra, _ = CASES[case]
    standard = {k: extra[k] for k in ("presence_penalty", "frequency_penalty", "logit_bias", "temperature", "seed")
                if k in extra}
    vllm_only = {k: v for k, v in extra.items() if k not in standard}
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                         **{"temperature": 0, **standard}, extra_body=vllm_only)
    ref = served[1][case]
    assert response.choices[0].text == ref.text
    assert response.usage.completion_tokens == len(ref.token_ids)


def test_chat_takes_the_developer_role_a_name_text_parts_and_prefers_max_completion_tokens(client, served):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=9,
                                              max_completion_tokens=3, user="u-1", metadata={"a": "b"},
                                              store=False, service_tier="auto", parallel_tool_calls=False)
    ref = served[1]["chat"]
    assert response.choices[0].message.content == ref.outputs[0].text
    assert response.usage.completion_tokens == 3 and response.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert response.system_fingerprint.startswith("stagedserve-")  # the same for the same model and configuration


def test_fields_that_change_nothing_are_accepted_logged_and_leave_the_answer_as_it_was(client, served, caplog):
    first = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           temperature=0)
    # The openai client's own assistant message sent back as it came (refusal, annotations, audio: null).
    history = [{"role": "user", "content": "Hi"}, first.choices[0].message.model_dump(), {"role": "user",
                                                                                         "content": "More"}]
    plain = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
    log_ignored.cache_clear()  # each field is logged once per process; another test may have sent it
    with caplog.at_level(logging.INFO, logger="stagedserve"):
        noted = client.chat.completions.create(
            model=MODEL, messages=[*history[:1], {**history[1], "annotations": []}, history[2]], max_tokens=4,
            temperature=0, safety_identifier="s-1", prompt_cache_key="k", verbosity="medium",
            extra_body={"prompt_cache_retention": "24h"})
        streamed = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0,
                                                  stream=True, stream_options={"include_obfuscation": False})
        streamed_text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert noted.choices[0].message.content == streamed_text == plain.choices[0].message.content
    for name in ("safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                 "stream_options.include_obfuscation", "messages.annotations"):
        assert f"request field '{name}' is accepted and changes nothing here" in caplog.text, name


def test_stream_chunks_carry_the_stop_reason_on_the_final_choice_chunk(served):
    # A bias makes token 7 come first; as a stop token it ends the request there.
    body = {"model": MODEL, "max_tokens": 5, "temperature": 0, "stop_token_ids": [7], "logit_bias": {"7": 100},
            "stream": True}
    with httpx.Client(base_url=served[0], headers=auth(KEY), timeout=60) as http:
        for path, extra in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": CHAT})):
            chunks = [e for e in sse_events(http.post(path, json={**body, **extra}).text.splitlines())
                      if e != "[DONE]" and e["choices"]]
            assert [c["choices"][0]["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [7], path
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(served):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.Client(base_url=served[0], headers=auth(KEY), timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = sse_events(response.iter_lines())
    chunks = [e for e in events if e != "[DONE]"]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 6 and all(c["usage"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("body, param", [
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"min_p": 2}, "min_p"),
    ({"min_tokens": 50, "max_tokens": 5}, "min_tokens"),
])
def test_bad_sampling_values_are_400s_naming_the_field(served, body, param):
    with httpx.Client(base_url=served[0], headers=auth(KEY), timeout=60) as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        ok = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert ok.status_code == 200


SEEDED = {"temperature": 0.9, "seed": 5, "max_tokens": 8, "ignore_eos": True}
BATCH = ["A scheduler", "Blocks of a few tokens"]


@pytest.fixture(scope="module")
def served_choices(tiny_llama):
    """Offline references: prompt i with seed 5 + j, for j < 3."""
    llm = make_llm(tiny_llama)
    refs = {(p, j): llm.generate(p, SamplingParams(**{**SEEDED, "seed": 5 + j}), use_tqdm=False)[0].outputs[0]
            for p in BATCH for j in range(3)}
    lengths = {p: len(llm.tokenizer.encode(p)) for p in BATCH}
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    with running_server(app) as server:
        yield server.url, refs, lengths


def test_n_and_batched_prompts_give_one_choice_per_prompt_and_sample_in_vllms_order(served_choices):
    url, refs, lengths = served_choices
    with OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        response = client.completions.create(model=MODEL, prompt=BATCH, n=3, temperature=0.9, seed=5, max_tokens=8,
                                             extra_body={"ignore_eos": True})
        assert [c.index for c in response.choices] == list(range(6))
        for choice in response.choices:
            prompt, sample = BATCH[choice.index // 3], choice.index % 3  # choice i * n + j, as vLLM
            assert choice.text == refs[(prompt, sample)].text
        assert response.usage.prompt_tokens == sum(lengths.values())  # each prompt once
        assert response.usage.completion_tokens == 6 * 8
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                              temperature=0.9, seed=5, max_tokens=4)
        assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8
        assert client.completions.create(model=MODEL, prompt=BATCH[0], n=2, best_of=2, max_tokens=2).choices


def test_a_streamed_n_request_streams_every_choice_with_its_index(served_choices):
    url, refs, _ = served_choices
    body = {"model": MODEL, "prompt": BATCH[1], "n": 3, "stream": True, **SEEDED,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=url, headers=auth(KEY), timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            events = sse_events(response.iter_lines())
    texts: dict[int, str] = {}
    finished = set()
    for event in events[:-2]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"] is not None:
                finished.add(choice["index"])
    assert texts == {j: refs[(BATCH[1], j)].text for j in range(3)} and finished == {0, 1, 2}
    assert events[-2]["usage"]["completion_tokens"] == 24 and events[-1] == "[DONE]"


def test_best_of_other_than_n_is_refused_rather_than_dropped(served_choices):
    with httpx.Client(base_url=served_choices[0], headers=auth(KEY), timeout=60) as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "best_of": 3, "max_tokens": 2})
        assert response.status_code == 400 and "best_of" in response.json()["error"]["message"]


SCORED = "Hello, world! How are you today?"


@pytest.fixture(scope="module")
def served_echo(tiny_llama):
    llm = make_llm(tiny_llama)
    scored = llm.generate(SCORED, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2,
                                                 logprobs=2), use_tqdm=False)[0]
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    with running_server(app) as server:
        yield server.url, scored, llm.tokenizer


def test_echo_with_max_tokens_0_and_logprobs_scores_the_prompt_as_lm_eval_asks(served_echo):
    url, scored, tokenizer = served_echo
    with OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        response = client.completions.create(model=MODEL, prompt=SCORED, echo=True, max_tokens=0, logprobs=2,
                                             temperature=0)
    choice = response.choices[0]
    assert choice.text == SCORED
    ids = scored.prompt_token_ids
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = [entry[t].logprob for t, entry in zip(ids[1:], scored.prompt_logprobs[1:])]
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) >= 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(ids))]


def test_echo_with_generation_puts_the_prompt_in_front_streamed_or_not(served_echo):
    url, scored, _ = served_echo
    body = {"model": MODEL, "prompt": SCORED, "echo": True, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}
    with httpx.Client(base_url=url, headers=auth(KEY), timeout=60) as http:
        whole = http.post("/v1/completions", json=body).json()["choices"][0]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = sse_events(response.iter_lines())
    assert whole["text"] == SCORED + scored.outputs[0].text
    assert len(whole["logprobs"]["tokens"]) == len(scored.prompt_token_ids) + 4
    assert whole["logprobs"]["text_offset"][len(scored.prompt_token_ids)] == len(SCORED)
    streamed = "".join(c["text"] for e in events if e != "[DONE]" for c in e["choices"])
    assert streamed == whole["text"]


def test_echo_puts_each_prompt_of_a_batch_in_front_of_each_of_its_samples(served_echo):
    url, scored, tokenizer = served_echo
    prompts = [SCORED, tokenizer.encode("Good morning", False)]  # text, and token ids (echoed decoded)
    body = {"model": MODEL, "prompt": prompts, "echo": True, "n": 2, "max_tokens": 2, "seed": 3}
    with httpx.Client(base_url=url, headers=auth(KEY), timeout=60) as http:
        whole = http.post("/v1/completions", json=body).json()["choices"]
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = [e for e in sse_events(response.iter_lines()) if e != "[DONE]"]
    streamed = ["".join(c["text"] for e in events for c in e["choices"] if c["index"] == i) for i in range(4)]
    for texts in ([c["text"] for c in whole], streamed):
        assert [t.startswith(p) for t, p in zip(texts, [SCORED, SCORED, "Good morning", "Good morning"])] == [True] * 4


def test_text_offsets_index_the_returned_text_and_give_left_out_special_tokens_no_width(served_echo):
    url, _, tokenizer = served_echo
    special = sorted(tokenizer.special_token_ids)[1]  # "<|im_start|>": decoded text leaves it out
    ids = tokenizer.encode("Hello, world", False)
    prompt = ids[:2] + [special] + ids[2:]
    body = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 0, "temperature": 0}
    with httpx.Client(base_url=url, headers=auth(KEY), timeout=60) as http:
        echoed = http.post("/v1/completions", json=body).json()["choices"][0]
        # Every generated token is the special one (a bias): the text is empty, so every offset is 0.
        generated = http.post("/v1/completions", json={**body, "echo": False, "max_tokens": 3, "ignore_eos": True,
                                                         "logit_bias": {str(special): 100}}).json()["choices"][0]
    text = tokenizer.decode(prompt)
    assert echoed["text"] == text and tokenizer.decode([special], False) not in text
    assert echoed["logprobs"]["text_offset"] == [len(tokenizer.decode(prompt[:i])) for i in range(len(prompt))]
    assert [text[o:o + len(t)] == t for o, t in zip(echoed["logprobs"]["text_offset"], echoed["logprobs"]["tokens"])
            ] == [t != special for t in prompt]
    assert generated["text"] == "" and generated["logprobs"]["text_offset"] == [0, 0, 0]
