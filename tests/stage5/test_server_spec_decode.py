"""Speculative decoding behind the server: ``--speculative-config`` (or ``LLM(speculative_config=...)``)
is checked once, the OpenAI client gets the plain greedy answer, and ``/metrics`` counts drafts
under vLLM's names."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from shared import SamplingParams
from stage5_server import LLM
from stage5_server.server import create_app
from stage5_server.spec_decode import SpeculativeConfig
from tests.stage5.server_fixtures import (
    auth,
    make_llm,
    metric,
    running_server,
    serving_or_exited,
    spawn_serve,
    stop_serve,
    wait_until,
)

KEY = "test-key-spec"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Many distinct tokens, so that some of the tiny model's output tokens occurred before (drafts to verify).
PROMPT = ("A paged KV cache gives every request fixed-size blocks; the scheduler spends one token budget per "
          "step, decode first, then prefill chunks, and preempts the newest request when blocks run out.")
MAX_TOKENS = 24


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method: must be one of"),
    ({"num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "num_speculative_tokens: must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens: must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min: 4 is more than prompt_lookup_max 2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min: must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "ngram uses no model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "draft_model needs the draft checkpoint"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, "unknown key 'k'"),
    ("{not json", "speculative_config: not JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_a_bad_speculative_config_is_a_value_error_naming_the_key(value, message, tiny_llama):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        LLM(str(tiny_llama), device="cpu", speculative_config=value)


def test_prompt_lookup_bounds_default_as_vllms():
    assert SpeculativeConfig.create({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    one = SpeculativeConfig.create('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig.create({"model": "/d", "num_speculative_tokens": 2}).method == "draft_model"


def test_openai_client_gets_the_plain_greedy_answer_and_metrics_count_the_drafts(tiny_llama):
    plain = make_llm(tiny_llama).generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                          use_tqdm=False)[0].outputs[0]
    llm = make_llm(tiny_llama, speculative_config=NGRAM)
    app = create_app(llm, api_keys=[KEY], served_model_name="tiny", log_stats_interval=None)
    with running_server(app) as server, OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                                               timeout=60) as client:
        response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert response.choices[0].text == plain.text
        streamed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                             stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == plain.text
        text = httpx.get(f"{server.url}/metrics", headers=auth(KEY)).text
    drafts = metric(text, "vllm:spec_decode_num_drafts_total", model_name="tiny", engine="0")
    draft_tokens = metric(text, "vllm:spec_decode_num_draft_tokens_total", model_name="tiny", engine="0")
    accepted = metric(text, "vllm:spec_decode_num_accepted_tokens_total", model_name="tiny", engine="0")
    assert drafts and drafts > 0 and draft_tokens >= drafts and accepted is not None
    stats = llm.engine.stats()
    assert (drafts, draft_tokens, accepted) == (stats.spec_decoding.num_drafts, stats.spec_decoding.num_draft_tokens,
                                                stats.spec_decoding.num_accepted_tokens)
    for position, count in enumerate(stats.spec_decoding.num_accepted_tokens_per_pos):
        assert metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name="tiny", engine="0",
                      position=str(position)) == count


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_stagedserve_serve_with_speculative_config_answers_the_plain_tokens(tiny_llama, tmp_path, method):
    """Through the engine process: the n-gram proposer in the core, or a draft model (the target's
    first layer and head) on the worker there."""
    from stage5_server.spec_decode.draft_checkpoint import write_layer_prefix_checkpoint

    plain = make_llm(tiny_llama, max_model_len=128).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)[0].outputs[0]
    spec = json.dumps({"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                       "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": str(
                           write_layer_prefix_checkpoint(tiny_llama, tmp_path / "draft", 1))}}[method])
    log = (tmp_path / "serve.log").open("w+")
    process, url = spawn_serve(tiny_llama, log, "--max-model-len", "128", "--num-kv-blocks", "32",
                               "--served-model-name", "tiny", "--log-stats-interval", "0.2",
                               "--speculative-config", spec)
    try:
        assert wait_until(serving_or_exited(process, url), timeout=90, interval=0.2) and process.poll() is None
        with OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60) as client:
            response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert response.choices[0].text == plain.text
        assert wait_until(lambda: "Spec decode acceptance rate" in tmp_path.joinpath("serve.log").read_text(), 10)
    finally:
        assert stop_serve(process, timeout=30) == 0
