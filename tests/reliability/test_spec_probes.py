"""Speculative decoding probed as a careless operator and client would: bad ``--speculative-config``
values stop ``stagedserve serve`` with the key named and exit code 2 before any engine process starts
(no traceback); a huge ``num_speculative_tokens`` still serves; and with drafts on, structured
outputs (choice, regex, JSON schema, grammar) hold and equal the plain engine's greedy answer, n > 1
with a seed is deterministic, and a greedy batch of prompts is the plain engine's text. The
tiny Llama behind the real server, the n-gram proposer and a draft model."""

from __future__ import annotations

import json

import pytest
import requests

from stage5_server.cli import main
from stage5_server.server import create_app
from tests.stage5.server_fixtures import auth, make_llm, running_server

KEY = "spec-probe-key"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPT = "one two three one two three one two three one two"


@pytest.mark.parametrize("value, message", [
    ("{bad", "not JSON"),
    ("[1]", "not a JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "speculative_config.method: must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": -1}', "num_speculative_tokens: must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens: must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens: must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "num_speculative_tokens: must be an integer >= 1"),
    ('{"method": "ngram"}', "num_speculative_tokens: must be an integer >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 9, "prompt_lookup_max": 2}',
     "prompt_lookup_min: 9 is more than"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "draft_model needs the draft checkpoint"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "eagle": true}', "unknown key 'eagle'"),
])
def test_a_bad_speculative_config_stops_serve_before_any_engine_starts(tiny_llama, value, message, capsys,
                                                                       monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the server started"))
    with pytest.raises(SystemExit) as exc:  # argparse's exit: the command line, before any engine process
        main(["serve", str(tiny_llama), "--speculative-config", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "stagedserve serve: error: argument --speculative-config: " in err and message in err, err
    assert "Traceback" not in err and "engine core" not in err


def test_a_missing_draft_checkpoint_is_a_clear_start_up_error(tiny_llama, capsys, monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the server started"))
    spec = json.dumps({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent/draft"})
    assert main(["serve", str(tiny_llama), "--max-model-len", "128", "--speculative-config", spec]) == 2
    err = capsys.readouterr().err
    assert "no config.json in /nonexistent/draft" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def servers(tiny_llama, tmp_path_factory):
    from stage5_server.spec_decode.draft_checkpoint import write_layer_prefix_checkpoint

    draft = write_layer_prefix_checkpoint(tiny_llama, tmp_path_factory.mktemp("draft") / "draft", 1)
    apps = {"plain": create_app(make_llm(tiny_llama), api_keys=[KEY], served_model_name="tiny"),
            "ngram": create_app(make_llm(tiny_llama, speculative_config=NGRAM), api_keys=[KEY],
                                served_model_name="tiny"),
            "draft": create_app(make_llm(tiny_llama, speculative_config={
                "method": "draft_model", "num_speculative_tokens": 3, "model": str(draft)}),
                api_keys=[KEY], served_model_name="tiny"),
            "huge-k": create_app(make_llm(tiny_llama, speculative_config={"method": "ngram",
                                                                          "num_speculative_tokens": 10 ** 9}),
                                 api_keys=[KEY], served_model_name="tiny")}
    with running_server(apps["plain"]) as plain, running_server(apps["ngram"]) as ngram, \
            running_server(apps["draft"]) as drafted, running_server(apps["huge-k"]) as huge:
        yield {"plain": plain.url, "ngram": ngram.url, "draft": drafted.url, "huge-k": huge.url}


def complete(url: str, **extra) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, **extra}
    response = requests.post(f"{url}/v1/completions", json=body, headers=auth(KEY), timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def texts(body: dict) -> list[str]:
    return [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]


def test_a_huge_num_speculative_tokens_still_answers_the_plain_greedy_tokens(servers):
    assert texts(complete(servers["huge-k"], ignore_eos=True)) == texts(complete(servers["plain"], ignore_eos=True))


@pytest.mark.parametrize("spec", ["ngram", "draft"])
@pytest.mark.parametrize("constraint", [
    {"structured_outputs": {"choice": ["one two three", "four five", "six"]}},
    {"structured_outputs": {"regex": "(one|two|three)( (one|two|three)){3}"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"word": {"enum": ["one", "two"]}}, "required": ["word"]}}}},
    {"structured_outputs": {"grammar": 'root ::= "one" (" " ("two" | "three"))*'}},
])
def test_drafts_with_structured_outputs_give_the_plain_constrained_greedy_text(servers, spec, constraint):
    plain = texts(complete(servers["plain"], **constraint))
    assert texts(complete(servers[spec], **constraint)) == plain


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_n_with_a_seed_is_deterministic_and_greedy_is_the_plain_text(servers, spec):
    seeded = dict(n=3, temperature=0.8, seed=1234, max_tokens=12)
    first, second = texts(complete(servers[spec], **seeded)), texts(complete(servers[spec], **seeded))
    assert first == second and len(first) == 3
    prompts = {"prompt": [PROMPT, "a b a b a b a b", "x"], "max_tokens": 12, "ignore_eos": True}
    assert texts(complete(servers[spec], **prompts)) == texts(complete(servers["plain"], **prompts))


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_drafts_stream_the_same_constrained_text(servers, spec):
    constraint = {"structured_outputs": {"regex": "(one|two|three)( (one|two|three)){5}"}}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True, **constraint}
    with requests.post(f"{servers[spec]}/v1/completions", json=body, headers=auth(KEY), stream=True,
                       timeout=120) as response:
        lines = [line for line in response.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]
                       if json.loads(line[6:])["choices"])
    assert streamed == texts(complete(servers["plain"], **constraint))[0]
