"""Promises every stage keeps: same tokens as transformers, reproducible sampling, stop rules."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from shared import SamplingParams
from tests.invariants.prompts import PROMPTS, encode_all, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_greedy_matches_transformers_generate_on_ragged_batch(stage, checkpoints, family):
    model = checkpoints[family]
    prompt_ids = encode_all(model)
    expected = hf_greedy(model, prompt_ids, GREEDY.max_tokens)
    llm = stage.make_llm(model)
    outputs = llm.generate(list(PROMPTS), GREEDY, use_tqdm=False)
    for prompt, ids, out, want in zip(PROMPTS, prompt_ids, outputs, expected):
        assert out.prompt_token_ids == list(ids)
        assert out.outputs[0].token_ids == want, prompt
        assert out.outputs[0].finish_reason == "length"


def test_token_id_prompts_and_text_prompts_agree(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    prompt_ids = [list(ids) for ids in encode_all(tiny_llama)]
    by_text = llm.generate(list(PROMPTS), GREEDY, use_tqdm=False)
    by_ids = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_text] == [o.outputs[0].token_ids for o in by_ids]
    assert by_text[0].outputs[0].text == llm.tokenizer.decode(by_text[0].outputs[0].token_ids)


def test_seeded_sampling_is_reproducible_and_independent_of_batch(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    # Every other sampling rule too, so that each is shown to stay within its own row.
    processed = SamplingParams(temperature=1.1, min_p=0.05, top_k=80, max_tokens=16, seed=99, repetition_penalty=1.2,
                               presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 2.0, 9: -4.0},
                               bad_words=["the"], min_tokens=10, logprobs=2)
    alone = llm.generate(PROMPTS[1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    alone_processed = llm.generate(PROMPTS[3], processed, use_tqdm=False)[0].outputs[0]
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    crowd = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[1], PROMPTS[3], PROMPTS[4]]
    params = [others, seeded, others, SamplingParams(temperature=0.7, max_tokens=5, seed=7), processed,
              SamplingParams(temperature=0, max_tokens=9, repetition_penalty=0.5, logit_bias={5: 9.0}, logprobs=1)]
    in_batch = llm.generate(crowd, params, use_tqdm=False)
    assert alone == in_batch[1].outputs[0].token_ids
    assert alone_processed.token_ids == in_batch[4].outputs[0].token_ids
    for lone, batched in zip(alone_processed.logprobs, in_batch[4].outputs[0].logprobs):  # from the raw logits
        assert {t: lp.rank for t, lp in lone.items()} == {t: lp.rank for t, lp in batched.items()}
        assert all(abs(lp.logprob - batched[t].logprob) < 1e-4 for t, lp in lone.items())
    different_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=16, seed=99, ignore_eos=True)
    assert llm.generate(PROMPTS[1], different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    greedy = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert alone != greedy[:16]


def test_max_tokens_finishes_with_length(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_stop_token_id_finishes_with_stop_and_reports_the_token(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    free_run = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = next(i for i, t in enumerate(free_run) if i >= 3 and t not in free_run[:i])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[free_run[stop_at]])
    out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[: stop_at + 1]
    assert out.finish_reason == "stop" and out.stop_reason == free_run[stop_at]
    # As in vLLM, the stop token's text is not part of the output unless asked for.
    assert out.text == llm.tokenizer.decode(free_run[:stop_at])
    kept = llm.generate(PROMPTS[1], replace(params, include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == llm.tokenizer.decode(free_run[: stop_at + 1]) and kept.token_ids == out.token_ids
    # min_tokens holds the stop token back until that many tokens exist.
    late = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[free_run[stop_at]],
                          min_tokens=stop_at + 2)
    held = llm.generate(PROMPTS[1], late, use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= stop_at + 2 and free_run[stop_at] not in held.token_ids[:stop_at + 1]


def test_stop_string_cuts_text_before_it(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    full = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = next(full.text[i:i + 2] for i in range(4, len(full.text) - 2) if full.text[i:i + 2].strip()
                and full.text.find(full.text[i:i + 2]) == i)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.find(stop)]
    assert len(out.token_ids) < len(full.token_ids)
    kept = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                   include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: full.text.find(stop) + len(stop)] and kept.token_ids == out.token_ids
    # Text made by the first min_tokens tokens holds no stop string (vLLM's rule).
    guard = len(full.token_ids) - 2
    late = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                   min_tokens=guard), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) > guard and late.text.startswith(full.text[: full.text.find(stop) + len(stop)])


def test_streamed_text_never_shows_what_a_stop_string_later_takes_back(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    full = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = next(full[i:i + 3] for i in range(len(full) // 2, len(full) - 3)
                if "\ufffd" not in full[i:i + 3] and full.find(full[i:i + 3]) == i)
    request_id = llm.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                            stop=[stop, "never-generated"]))
    texts = []
    while llm.has_unfinished_requests():
        texts += [o.outputs[0].text for o in llm.step() if o.request_id == request_id]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative text only ever grows
    assert texts[-1] == full[: full.find(stop)] and not any(stop in t for t in texts)


def test_eos_finishes_with_stop_unless_ignored(stage, tiny_llama, tmp_path):
    llm = stage.make_llm(tiny_llama)
    free_run = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i, t in enumerate(free_run) if i >= 2 and t not in free_run[:i])
    # The same weights, with the k-th greedy token declared as EOS in config.json.
    model = tmp_path / "eos-model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = [free_run[k]]
    (model / "config.json").write_text(json.dumps(config))
    eos_llm = stage.make_llm(model)
    out = eos_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[: k + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    ignored = eos_llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == free_run and ignored.finish_reason == "length"


def test_chat_applies_the_models_template(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    rendered = llm.tokenizer.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == llm.tokenizer.hf.encode(rendered, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) == 4


def test_logprobs_report_the_sampled_token_and_top_alternatives(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    for token, alternatives in zip(out.token_ids, out.logprobs):
        assert alternatives[token].rank == 1  # greedy picks the most likely token
        assert len(alternatives) == 2 and all(lp.logprob <= 0 for lp in alternatives.values())
