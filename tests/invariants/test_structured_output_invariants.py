"""Structured output in every stage: greedy output under a grammar is valid, identical across
stages, and leaves the unconstrained requests of the same batch as they were."""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest

from shared import SamplingParams
from tests.conftest import STAGES
from tests.invariants.prompts import PROMPTS

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"type": "string", "enum": ["a", "bb", "ccc"]},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "tag", "ok"]}
CONSTRAINTS = [{"json": SCHEMA}, {"regex": r"[0-9]{3}-[a-z]{2}"}, {"choice": ["red", "green", "blue"]}]
FREE = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def constrained(spec: dict) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=120, structured_outputs=spec)


@functools.cache
def reference(tiny_llama) -> list[list[int]]:
    """Stage 1's token ids for the batch: the others must equal them."""
    return run(STAGES[0], tiny_llama)


def run(stage, tiny_llama) -> list[list[int]]:
    prompts = PROMPTS[:len(CONSTRAINTS) + 1]
    params = [constrained(c) for c in CONSTRAINTS] + [FREE]
    return [o.outputs[0].token_ids for o in stage.make_llm(tiny_llama).generate(prompts, params, use_tqdm=False)]


def test_greedy_output_under_a_grammar_is_valid_and_the_same_in_every_stage(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    prompts = PROMPTS[:len(CONSTRAINTS) + 1]
    outputs = llm.generate(prompts, [constrained(c) for c in CONSTRAINTS] + [FREE], use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert len(texts[1]) == 6 and texts[1][:3].isdigit() and texts[1][3] == "-"
    assert texts[2] in ("red", "green", "blue")
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs[:3])  # the grammar ended each one
    free_alone = llm.generate(prompts[-1], FREE, use_tqdm=False)[0].outputs[0].token_ids
    assert outputs[-1].outputs[0].token_ids == free_alone  # the masks stay in their rows
    assert [o.outputs[0].token_ids for o in outputs] == reference(tiny_llama)


def test_every_sample_of_n_follows_the_grammar(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=120, structured_outputs={"json": SCHEMA})
    [out] = llm.generate(PROMPTS[0], params, use_tqdm=False)
    for sample in out.outputs:
        jsonschema.validate(json.loads(sample.text), SCHEMA)


def test_a_schema_the_grammar_engine_refuses_fails_before_any_request_starts(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama)
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: "):
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs={"json": {"type": "integer", "minimum": "x"}}),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_preemption_keeps_each_requests_grammar_state(stage, tiny_llama):
    """A preempted request is recomputed from its tokens; its matcher already consumed them."""
    if stage.number < 3:
        pytest.skip("stages 1 and 2 do not preempt")
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": "[a-z ]{30}"}),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 2 + [constrained({"json": SCHEMA})]
    roomy = stage.make_llm(tiny_llama).generate(list(PROMPTS), params, use_tqdm=False)
    tight = stage.make_llm(tiny_llama, num_kv_blocks=24, max_num_batched_tokens=32, max_model_len=96)
    squeezed = tight.generate(list(PROMPTS), params, use_tqdm=False)
    assert tight.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in roomy]
    assert all(len(o.outputs[0].text) == 30 for o in squeezed[:4:2])
    jsonschema.validate(json.loads(squeezed[-1].outputs[0].text), SCHEMA)
