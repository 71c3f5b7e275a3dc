"""Bad input gets a clear error and loses nothing; KV always returns to the pool."""

from __future__ import annotations

import pytest

from shared import SamplingParams
from tests.invariants.prompts import PROMPTS
from tests.stage5.server_fixtures import engine_runner

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def assert_serves(llm):
    out = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
    assert llm.engine.kv_cache_usage() == 0


def test_all_kv_returns_to_the_pool_after_requests_finish(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 7, 30, 3, 12)]
    llm.generate(list(PROMPTS), params, use_tqdm=False)
    assert llm.engine.kv_cache_usage() == 0
    assert not llm.has_unfinished_requests()


def test_kv_returns_to_the_pool_when_a_step_fails(stage, tiny_llama, monkeypatch):
    llm = stage.make_llm(tiny_llama)
    runner, method = engine_runner(llm)
    real_execute = getattr(runner, method)
    calls = {"n": 0}

    def failing_execute(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure in the forward pass")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(runner, method, failing_execute)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(list(PROMPTS), GREEDY, use_tqdm=False)
    assert llm.engine.kv_cache_usage() == 0
    assert not llm.has_unfinished_requests()
    monkeypatch.setattr(runner, method, real_execute)
    assert_serves(llm)


def test_aborted_requests_free_their_kv(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    ids = [llm.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)) for p in PROMPTS]
    llm.step()
    llm.step()
    llm.abort(ids)
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.engine.kv_cache_usage() == 0
    assert_serves(llm)


@pytest.mark.parametrize("prompt, field", [
    ("", "prompt"),
    ([], "prompt"),
    (list(range(300)), "prompt"),  # longer than max_model_len=256
    ([10**9], "prompt"),  # outside the vocabulary
    (3.5, "prompt"),
])
def test_bad_prompt_is_a_value_error_and_the_engine_keeps_serving(stage, tiny_llama, prompt, field):
    llm = stage.make_llm(tiny_llama)
    with pytest.raises(ValueError, match=field):
        llm.generate([PROMPTS[0], prompt], GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests()  # the good prompt in the same call was not half-admitted
    assert_serves(llm)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": 100}, "logprobs"),
    ({"seed": "x"}, "seed"),
    ({"n": 0}, "n"),
    ({"n": 2, "temperature": 0}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"logit_bias": {10**6: 1.0}}, "logit_bias"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_refused_before_they_reach_the_sampler(stage, tiny_llama, kwargs,
                                                                                     field):
    llm = stage.make_llm(tiny_llama)
    with pytest.raises(ValueError, match=f"^{field}:"):
        llm.generate([PROMPTS[0], PROMPTS[1]], [GREEDY, SamplingParams(max_tokens=4, **kwargs)], use_tqdm=False)
    assert not llm.has_unfinished_requests()
    assert_serves(llm)


def test_unknown_engine_argument_is_named(stage, tiny_llama):
    with pytest.raises(ValueError, match="no_such_knob"):
        stage.make_llm(tiny_llama, no_such_knob=1)


def test_a_request_id_in_use_is_refused_and_the_first_request_still_finishes(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    llm.add_request(PROMPTS[0], GREEDY, request_id="same")
    with pytest.raises(ValueError, match="request_id"):
        llm.add_request(PROMPTS[1], GREEDY, request_id="same")
    finished = []
    while llm.has_unfinished_requests():
        finished += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in finished] == ["same"] and len(finished[0].outputs[0].token_ids) == 8
    assert llm.engine.kv_cache_usage() == 0


def test_generate_returns_its_own_outputs_while_other_requests_share_the_engine(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    llm.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), request_id="1")
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert "1" not in [o.request_id for o in outs]
