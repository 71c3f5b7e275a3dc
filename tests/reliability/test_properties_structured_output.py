"""Property: for random JSON schemas within the supported subset, every constrained completion
parses and validates (checked by the ``jsonschema`` package, not by the grammar engine).

The subset: objects (required and optional properties), arrays (bounded length), strings
(bounded length, enums, a pattern), integers and numbers (with bounds), booleans, null,
``anyOf`` and nesting up to depth 3. Bounds keep a random model's answer finite; the sampler
runs at temperature 1 with a seed per example, so the model explores the grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import SamplingParams
from tests.reliability.settings import DERANDOMIZE
from tests.stage5.server_fixtures import make_llm

NAMES = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)


def leaf_schemas() -> st.SearchStrategy[dict]:
    bounded_int = st.tuples(st.integers(-50, 50), st.integers(0, 100)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    number = st.tuples(st.integers(-5, 5), st.integers(1, 10)).map(
        lambda t: {"type": "number", "minimum": t[0], "maximum": t[0] + t[1]})
    string = st.integers(0, 6).map(lambda n: {"type": "string", "maxLength": n})
    enum = st.lists(st.text(alphabet="xyz é\"\\", min_size=1, max_size=4), min_size=1, max_size=4, unique=True).map(
        lambda values: {"type": "string", "enum": values})
    pattern = st.sampled_from(["^[a-c]{1,3}$", "^[0-9]{2}-[0-9]{2}$", "^(ab|cd)+$"]).map(
        lambda p: {"type": "string", "pattern": p, "maxLength": 8})
    return st.one_of(bounded_int, number, string, enum, pattern, st.just({"type": "boolean"}),
                     st.just({"type": "null"}))


def schemas() -> st.SearchStrategy[dict]:
    def extend(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        array = st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
            lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]})
        obj = st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
            lambda props: st.sets(st.sampled_from(sorted(props))).map(
                lambda required: {"type": "object", "properties": props, "required": sorted(required)}))
        any_of = st.lists(children, min_size=2, max_size=3).map(lambda options: {"anyOf": options})
        return st.one_of(array, obj, any_of)

    return st.recursive(leaf_schemas(), extend, max_leaves=6).filter(lambda s: len(json.dumps(s)) < 600)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama, max_model_len=1024, num_kv_blocks=256, max_num_batched_tokens=1024)


@pytest.mark.slow
def test_every_completion_under_a_random_schema_parses_and_validates(llm):
    @settings(max_examples=25, deadline=None, derandomize=DERANDOMIZE, database=None,
              suppress_health_check=list(HealthCheck))
    @given(schema=schemas(), seed=st.integers(0, 2**31))
    def check(schema, seed):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=400, structured_outputs={"json": schema})
        [output] = llm.generate("Answer in JSON:", params, use_tqdm=False)
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)  # the grammar, not the limit, ended it
        jsonschema.validate(json.loads(completion.text), schema)

    check()
