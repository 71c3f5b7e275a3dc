"""/metrics after real requests: vLLM's histograms of counts hold exactly what was sent.

One server of its own (so no other test's requests are counted), a fixed set of requests
(single and batched prompts, n > 1, streaming, a chat without a token limit), then one
scrape: each family's count, sum and buckets are checked against the responses' usage.
"""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stage5_server.server import create_app
from tests.stage5.server_fixtures import ENGINE_KWARGS, auth, make_llm, metric, running_server, sse_events

KEY = "metrics-key"
MODEL = "tiny-metrics"
LONG = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"


def histogram(text: str, name: str) -> dict[str, float]:
    """``{"count", "sum", le: cumulative count}`` of one histogram family."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_count":
                out["count"] = sample.value
            elif sample.name == f"{name}_sum":
                out["sum"] = sample.value
            elif sample.name == f"{name}_bucket":
                out[sample.labels["le"]] = sample.value
    return out


@pytest.fixture(scope="module")
def scraped(tiny_llama):
    """Send the requests; return (what they were, their responses' numbers, the /metrics text)."""
    llm = make_llm(tiny_llama)
    eos = llm.model_config.eos_token_ids[0]
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL)
    parents = []  # per prompt: (n, max_tokens or None, [completion tokens of each sample], prompt tokens)
    with running_server(app) as server, httpx.Client(base_url=server.url, headers=auth(KEY), timeout=120) as c:
        one = c.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 5, "ignore_eos": True}).json()
        parents.append((1, 5, [one["usage"]["completion_tokens"]], one["usage"]["prompt_tokens"]))

        prompts = [LONG, "hello"]
        batch = c.post("/v1/completions", json={"prompt": prompts, "n": 3, "max_tokens": 4, "seed": 1,
                                                "ignore_eos": True}).json()
        assert len(batch["choices"]) == 6
        for prompt in prompts:
            ids = c.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
            samples = [4] * 3  # ignore_eos: every sample runs to max_tokens
            parents.append((3, 4, samples, len(ids)))
        assert batch["usage"]["completion_tokens"] == 4 * 6

        lines = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_completion_tokens": 3, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}).text.splitlines()
        usage = [e for e in sse_events(lines) if e != "[DONE]"][-1]["usage"]
        parents.append((2, 3, [3, 3], usage["prompt_tokens"]))

        # No token limit: vLLM's max_tokens is then what the context leaves. A bias to EOS ends it at once.
        free = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "bye"}],
                                                    "logit_bias": {str(eos): 100}}).json()
        parents.append((1, None, [free["usage"]["completion_tokens"]], free["usage"]["prompt_tokens"]))
        text = c.get("/metrics").text
    return parents, text


def test_request_size_histograms_count_every_sample_and_sum_its_tokens(scraped):
    parents, text = scraped
    samples = [(prompt, tokens) for _, _, lengths, prompt in parents for tokens in lengths]
    prompt_hist = histogram(text, "vllm:request_prompt_tokens")
    generation_hist = histogram(text, "vllm:request_generation_tokens")
    assert prompt_hist["count"] == generation_hist["count"] == len(samples) == 10
    assert prompt_hist["sum"] == sum(p for p, _ in samples)
    assert generation_hist["sum"] == sum(t for _, t in samples)
    assert generation_hist["5.0"] == len(samples)  # every sample generated at most 5 tokens
    assert generation_hist["2.0"] == sum(t <= 2 for _, t in samples) >= 1  # the EOS-biased one
    assert metric(text, "vllm:request_success_total", model_name=MODEL) == len(samples)


def test_every_sample_is_timed_on_both_sides_of_the_engine_core(scraped):
    parents, text = scraped
    samples = sum(len(lengths) for _, _, lengths, _ in parents)
    for name in ("vllm:e2e_request_latency_seconds", "stagedserve:request_frontend_in_time_seconds",
                 "stagedserve:request_frontend_out_time_seconds"):
        assert histogram(text, name)["count"] == samples, name


def test_max_tokens_histogram_holds_each_samples_limit_or_what_the_context_leaves(scraped):
    parents, text = scraped
    limits = [max_tokens if max_tokens is not None else ENGINE_KWARGS["max_model_len"] - prompt
              for n, max_tokens, _, prompt in parents for _ in range(n)]
    hist = histogram(text, "vllm:request_params_max_tokens")
    assert (hist["count"], hist["sum"]) == (len(limits), sum(limits))
    assert hist["5.0"] == len(limits) - 1  # all but the chat without a limit
    assert list(hist) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "+Inf", "count", "sum"]


def test_n_and_longest_sample_are_counted_once_per_prompt(scraped):
    parents, text = scraped
    n_hist = histogram(text, "vllm:request_params_n")
    assert (n_hist["count"], n_hist["sum"]) == (len(parents), sum(n for n, *_ in parents)) == (5, 10)
    assert (n_hist["1.0"], n_hist["2.0"], n_hist["5.0"], n_hist["20.0"]) == (2, 3, 5, 5)  # vLLM's buckets
    longest = histogram(text, "vllm:request_max_num_generation_tokens")
    assert (longest["count"], longest["sum"]) == (len(parents), sum(max(lengths) for _, _, lengths, _ in parents))


def test_iteration_tokens_add_up_to_the_prompt_and_generation_counters(scraped):
    _, text = scraped
    steps = histogram(text, "vllm:iteration_tokens_total")
    computed = metric(text, "vllm:prompt_tokens_total") + metric(text, "vllm:generation_tokens_total")
    assert steps["sum"] == computed
    assert steps["+Inf"] == steps["count"] >= 5  # at least one step per request
    assert steps["1.0"] >= 1  # a decode step of the lone unlimited chat ran one token
    assert list(steps)[:13] == [f"{float(b)}" for b in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                        16384)]


def test_prefill_and_preemption_histograms_agree_with_the_cache_counters(scraped):
    _, text = scraped
    prompt_hist = histogram(text, "vllm:request_prompt_tokens")
    computed = histogram(text, "vllm:request_prefill_kv_computed_tokens")
    cached = metric(text, "vllm:prompt_tokens_cached_total")
    assert cached == metric(text, "vllm:prefix_cache_hits_total")
    assert cached == metric(text, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == \
        metric(text, "vllm:prompt_tokens_cached_by_source_total", source="device") == \
        metric(text, "vllm:prompt_tokens_cached_by_source_total")  # every other tier is 0
    assert metric(text, "vllm:prompt_tokens_by_source_total", source="local_compute") == \
        metric(text, "vllm:prompt_tokens_total")
    assert metric(text, "vllm:num_requests_waiting_by_reason", reason="capacity") == \
        metric(text, "vllm:num_requests_waiting") == 0  # all finished
    assert (computed["count"], computed["sum"]) == (prompt_hist["count"], prompt_hist["sum"] - cached)
    preemptions = histogram(text, "vllm:request_num_preemptions")
    assert (preemptions["count"], preemptions["sum"]) == (prompt_hist["count"], metric(text,
                                                                                       "vllm:num_preemptions_total"))


def test_cache_config_info_is_one_with_the_resolved_kv_cache_as_labels(scraped):
    _, text = scraped
    assert metric(text, "vllm:cache_config_info", engine="0", block_size="16", num_gpu_blocks="160",
                  num_gpu_blocks_override="160", enable_prefix_caching="True", kv_cache_size_tokens="2560",
                  prefix_caching_hash_algo="sha256", cache_dtype="float32") == 1
