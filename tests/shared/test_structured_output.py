"""The structured-output module on its own: specs, the front end's check, the grammar cache,
the per-request matcher and the logits mask (no engine)."""

from __future__ import annotations

import json
import threading

import llguidance
import pytest
import torch

from shared import Request, SamplingParams, Tokenizer
from shared.structured_output import (
    StructuredOutputManager,
    StructuredOutputsParams,
    apply_grammar_bitmask,
    check_structured_outputs,
    grammar_text,
    no_extra_properties,
    unpack_bitmask,
)

EOS = (0, 2)  # the tiny checkpoints' <|endoftext|> and <|im_end|>


@pytest.fixture(scope="module")
def manager(tiny_llama):
    tok = Tokenizer(tiny_llama)
    return StructuredOutputManager(tok.hf, vocab_size=512, stop_token_ids=EOS)


def grammar_request(manager, spec: StructuredOutputsParams, rid: str = "r") -> Request:
    request = Request(rid, [1, 2, 3], SamplingParams(temperature=0, structured_outputs=spec), eos_token_ids=EOS)
    manager.grammar_init(request)
    request.structured_output_request.grammar.result(timeout=60)
    return request


def allowed_tokens(request: Request, vocab: int = 512) -> set[int]:
    logits = apply_grammar_bitmask(torch.zeros(1, vocab), [request])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def text_of(tiny_llama, token_ids) -> str:
    return Tokenizer(tiny_llama).decode(token_ids)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of"),
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
    ({"json": ["not", "a", "schema"]}, "structured_outputs.json: must be a JSON schema"),
    ({"choice": []}, "structured_outputs.choice: must be a non-empty list"),
    ({"choice": ["a", 3]}, "structured_outputs.choice: must be a non-empty list"),
    ({"regex": ""}, "structured_outputs.regex: must be a non-empty string"),
    ({"json_object": True, "any_whitespace": "yes"}, "structured_outputs.any_whitespace: must be a bool"),
])
def test_a_malformed_spec_is_a_value_error_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "integer", "minimum": "three"}), "structured_outputs.json: "),
    (dict(json={"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}), "missing"),
    (dict(json={"not": {"type": "string"}}), "not"),
    (dict(json={"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}), "oneOf"),
    (dict(json={"type": "string", "format": "no-such-format"}), "no-such-format"),
    (dict(json="[1, 2"), "structured_outputs.json: not valid JSON"),
    (dict(json="[1, 2]"), "structured_outputs.json: a JSON schema must be an object"),
    (dict(regex="a{2,1}"), "structured_outputs.regex: "),
    (dict(grammar='root ::= "a" missing'), "structured_outputs.grammar: "),
])
def test_the_front_end_check_refuses_what_the_grammar_cannot_enforce(spec, message):
    with pytest.raises(ValueError, match=message):
        check_structured_outputs(StructuredOutputsParams(**spec))


def test_the_check_accepts_what_pydantic_and_openai_clients_send():
    # The shape of pydantic's model_json_schema() for a nested model, and an OpenAI strict schema.
    pydantic_like = {
        "$defs": {"Address": {"properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"],
                              "title": "Address", "type": "object"}},
        "properties": {"name": {"title": "Name", "type": "string"}, "age": {"anyOf": [{"type": "integer"},
                                                                                      {"type": "null"}],
                                                                            "default": None, "title": "Age"},
                       "home": {"$ref": "#/$defs/Address"},
                       "kind": {"enum": ["a", "b"], "title": "Kind", "type": "string"}},
        "required": ["name", "home", "kind"], "title": "Person", "type": "object",
    }
    strict = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": ["string", "null"]}},
              "required": ["city", "unit"], "additionalProperties": False}
    for schema in (pydantic_like, strict, json.dumps(strict)):
        check_structured_outputs(StructuredOutputsParams(json=schema))


def test_objects_that_list_properties_get_no_extra_ones_unless_the_schema_says():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"a": {"type": "integer"}}},  # a property named "properties"
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "both": {"allOf": [{"properties": {"x": {"type": "integer"}}}, {"properties": {"y": {"type": "integer"}}}]},
        "list": {"type": "array", "items": {"properties": {"z": {"type": "string"}}}},
    }}
    strict = no_extra_properties(schema)
    assert strict["additionalProperties"] is False
    props = strict["properties"]
    assert set(props) == {"properties", "open", "both", "list"}
    assert props["properties"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert "additionalProperties" not in props["both"]["allOf"][0]
    assert props["list"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_json_is_compact_unless_any_whitespace_is_asked_for(manager):
    compact = grammar_request(manager, StructuredOutputsParams(json_object=True))
    loose = grammar_request(manager, StructuredOutputsParams(json_object=True, any_whitespace=True))
    newline_tokens = {t for t in range(512) if manager.hf_tokenizer.decode([t]).strip() == "" and
                      "\n" in manager.hf_tokenizer.decode([t])}
    brace = manager.hf_tokenizer.convert_tokens_to_ids("{")
    for request in (compact, loose):
        request.append_output_token(brace)
    assert newline_tokens and not newline_tokens & allowed_tokens(compact)
    assert newline_tokens <= allowed_tokens(loose)


def test_the_same_spec_is_built_once_and_each_request_gets_its_own_matcher(manager, tiny_llama):
    spec = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    before = manager.num_built
    first = grammar_request(manager, StructuredOutputsParams(json=spec), "a")
    second = grammar_request(manager, StructuredOutputsParams(json=json.loads(json.dumps(spec))), "b")
    assert manager.num_built == before + 1
    assert first.structured_output_request.grammar is second.structured_output_request.grammar
    start = allowed_tokens(second)
    first.append_output_token(manager.hf_tokenizer.convert_tokens_to_ids("{"))
    assert allowed_tokens(second) == start != allowed_tokens(first)


def test_building_happens_off_the_calling_thread(tiny_llama):
    manager = StructuredOutputManager(Tokenizer(tiny_llama).hf, 512, EOS, max_workers=1)
    gate = threading.Event()
    manager.executor.submit(gate.wait)  # the only build thread is busy
    request = Request("r", [1], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                      eos_token_ids=EOS)
    manager.grammar_init(request)  # returns although nothing can be built yet
    assert request.waiting_for_grammar
    gate.set()
    request.structured_output_request.grammar.result(timeout=60)
    assert not request.waiting_for_grammar and not request.grammar_failed
    manager.shutdown()


def test_the_matcher_follows_the_output_tokens_and_replays_them_after_a_rollback(manager, tiny_llama):
    request = grammar_request(manager, StructuredOutputsParams(choice=["yes", "no"]))
    yes = Tokenizer(tiny_llama).encode("yes")
    assert set(allowed_tokens(request)) >= {yes[0]}
    for token in yes:
        request.append_output_token(token)
    assert allowed_tokens(request) == set(EOS)  # complete: only EOS may follow
    done_state = request.structured_output_request.num_accepted
    # Outputs rolled back to the first token: the matcher replays instead of keeping its state.
    request.output_token_ids[1:] = []
    after_rollback = allowed_tokens(request)
    assert request.structured_output_request.num_accepted == 1 < done_state
    fresh = grammar_request(manager, StructuredOutputsParams(choice=["yes", "no"]), "fresh")
    fresh.append_output_token(yes[0])
    assert after_rollback == allowed_tokens(fresh)


def test_eos_after_a_complete_grammar_terminates_it(manager, tiny_llama):
    request = grammar_request(manager, StructuredOutputsParams(choice=["no"]))
    for token in Tokenizer(tiny_llama).encode("no"):
        request.append_output_token(token)
    assert not request.structured_output_request.is_terminated(request.output_token_ids)
    request.append_output_token(EOS[1])
    assert request.structured_output_request.is_terminated(request.output_token_ids)


def test_the_mask_leaves_unconstrained_rows_alone_and_matches_llguidance(manager, tiny_llama):
    constrained = grammar_request(manager, StructuredOutputsParams(regex="[0-9]+"))
    free = Request("free", [1], SamplingParams(), eos_token_ids=EOS)
    logits = torch.randn(2, 512)
    masked = apply_grammar_bitmask(logits.clone(), [free, constrained])
    assert torch.equal(masked[0], logits[0])
    tok = llguidance.hf.from_tokenizer(manager.hf_tokenizer, n_vocab=512, eos_token=list(EOS))
    reference = llguidance.LLMatcher(tok, grammar_text(StructuredOutputsParams(regex="[0-9]+")), log_level=0)
    allowed = torch.frombuffer(bytearray(reference.compute_logit_bias()), dtype=torch.uint8)[:512] > 0
    assert torch.equal(torch.isfinite(masked[1]), allowed)
    assert all(text_of(tiny_llama, [t]).isdigit() for t in torch.nonzero(allowed).flatten().tolist())


def test_bitmask_bit_t_mod_32_of_word_t_div_32_allows_token_t():
    tokens = [0, 31, 32, 70]
    words = [sum(1 << (t % 32) for t in tokens if t // 32 == w) for w in range(3)]
    bitmask = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in words]], dtype=torch.int32)
    allowed = unpack_bitmask(bitmask, 80)
    assert torch.nonzero(allowed[0]).flatten().tolist() == tokens
