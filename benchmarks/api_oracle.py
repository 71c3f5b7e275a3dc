"""vLLM's server as the oracle: the same requests to vLLM and to stagedserve, and where they differ.

Starts ``stagedserve serve`` and vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``
from vLLM's own virtual environment, as ``benchmarks/vllm_peer.py`` runs vLLM) on the same
checkpoint, each with an API key, sends each of about a hundred requests (completions, chat,
streaming, batched prompts, sampling fields, bad input, the other routes) to both, and prints,
per request, the two status codes and where the response *shapes* differ: keys present on one
side only, and values of different JSON types (a streamed response is the union of its chunks'
shapes). Values themselves are not compared: the two engines sample differently.

With ``--pooling-model DIR`` (an embedding model: ``all-minilm-l6-v2``'s directory) a second pair of
servers answers the pooling routes' requests (embeddings, ``/pooling``, Cohere's ``/v2/embed``, score
under each of its field names, rerank).

Not a test (vLLM's CPU build is a heavy install); the Serving page summarizes its last run.

    python -m benchmarks.api_oracle --vllm-python /path/to/vllm-venv/bin/python [--model DIR] [--pooling-model DIR]

``--vllm-url``/``--vllm-key`` and ``--stagedserve-url``/``--stagedserve-key`` use servers that
are already running instead. Writes ``benchmarks/results/api_oracle.json`` and
``docs/results/api_oracle.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from benchmarks.common import run_info, write_results

MODEL_NAME = "oracle"


def requests_to_send(token_ids: list[int]) -> list[tuple[str, str, str, dict | None]]:
    """(name, method, path, JSON body) for every request the oracle sends."""
    completion = {"model": MODEL_NAME, "prompt": "Hello, world!", "max_tokens": 5}
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Add 4 and 5."}], "max_tokens": 5}
    stream = {"stream": True}
    c = [
        ("basic", {}), ("greedy", {"temperature": 0}), ("seeded", {"temperature": 0.8, "seed": 1}),
        ("top_p top_k min_p", {"top_p": 0.9, "top_k": 20, "min_p": 0.1}),
        ("n=2", {"n": 2}), ("n=3 seeded", {"n": 3, "seed": 0}), ("n=2 greedy", {"n": 2, "temperature": 0}),
        ("best_of=2", {"best_of": 2}), ("best_of=3 n=2", {"best_of": 3, "n": 2}),
        ("echo", {"echo": True}), ("echo max_tokens=0", {"echo": True, "max_tokens": 0}),
        ("echo max_tokens=0 logprobs=1", {"echo": True, "max_tokens": 0, "logprobs": 1}),
        ("echo logprobs=2", {"echo": True, "logprobs": 2}), ("max_tokens=0", {"max_tokens": 0}),
        ("logprobs=0", {"logprobs": 0}), ("logprobs=3", {"logprobs": 3}),
        ("logprobs=5 greedy", {"logprobs": 5, "temperature": 0}), ("logprobs=21", {"logprobs": 21}),
        ("prompt: two strings", {"prompt": ["Hello", "world"]}),
        ("prompt: two strings n=2", {"prompt": ["Hello", "world"], "n": 2}),
        ("prompt: token ids", {"prompt": token_ids}),
        ("prompt: two token-id lists", {"prompt": [token_ids, token_ids[:3]]}),
        ("prompt: empty string", {"prompt": ""}), ("prompt: empty list", {"prompt": []}),
        ("prompt missing", {"prompt": None}),
        ("presence_penalty", {"presence_penalty": 0.5}), ("frequency_penalty", {"frequency_penalty": 0.5}),
        ("repetition_penalty", {"repetition_penalty": 1.2}), ("presence_penalty=3", {"presence_penalty": 3}),
        ("logit_bias", {"logit_bias": {str(token_ids[0]): 10}}), ("logit_bias bad key", {"logit_bias": {"x": 1}}),
        ("stop", {"stop": ["e"]}),
        ("stop include_stop_str_in_output", {"stop": "e", "include_stop_str_in_output": True}),
        ("stop_token_ids", {"stop_token_ids": [token_ids[0]]}), ("ignore_eos", {"ignore_eos": True}),
        ("min_tokens", {"min_tokens": 3}), ("suffix", {"suffix": "x"}), ("user", {"user": "u-1"}),
        ("seed int64 max", {"seed": 2**63 - 1}), ("max_tokens=-1", {"max_tokens": -1}),
        ("max_tokens over context", {"max_tokens": 100000}), ("temperature=-1", {"temperature": -1}),
        ("top_p=0", {"top_p": 0}), ("n=0", {"n": 0}), ("wrong model", {"model": "nope"}),
        ("unknown field", {"foo": 1}), ("prompt_logprobs=1", {"prompt_logprobs": 1}),
        ("allowed_token_ids", {"allowed_token_ids": token_ids[:3]}),
        ("skip_special_tokens=false", {"skip_special_tokens": False}),
        ("truncate_prompt_tokens", {"truncate_prompt_tokens": 2}), ("return_token_ids", {"return_token_ids": True}),
        ("stream", stream), ("stream include_usage", {**stream, "stream_options": {"include_usage": True}}),
        ("stream continuous_usage_stats",
         {**stream, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
        ("stream n=2", {**stream, "n": 2}), ("stream logprobs=2", {**stream, "logprobs": 2}),
        ("stream echo", {**stream, "echo": True}), ("stream two prompts", {**stream, "prompt": ["a", "b"]}),
        ("stream stop", {**stream, "stop": ["e"]}),
        ("stream_options without stream", {"stream_options": {"include_usage": True}}),
    ]
    h = [
        ("basic", {}), ("greedy", {"temperature": 0}), ("seeded", {"temperature": 0.8, "seed": 1}),
        ("system + user", {"messages": [{"role": "system", "content": "Be brief."}, *chat["messages"]]}),
        ("developer role", {"messages": [{"role": "developer", "content": "Be brief."}, *chat["messages"]]}),
        ("message name", {"messages": [{"role": "user", "content": "Hi", "name": "ann"}]}),
        ("content parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Add 4"},
                                                                     {"type": "text", "text": "and 5."}]}]}),
        ("image part", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
        ("multi-turn", {"messages": [*chat["messages"], {"role": "assistant", "content": "9"},
                                     {"role": "user", "content": "And 6 and 7?"}]}),
        ("max_completion_tokens", {"max_tokens": None, "max_completion_tokens": 4}),
        ("max_tokens and max_completion_tokens", {"max_tokens": 6, "max_completion_tokens": 3}),
        ("max_tokens=0", {"max_tokens": 0}),
        ("n=2", {"n": 2}), ("n=2 greedy", {"n": 2, "temperature": 0}),
        ("logprobs", {"logprobs": True}), ("logprobs top_logprobs=3", {"logprobs": True, "top_logprobs": 3}),
        ("top_logprobs without logprobs", {"top_logprobs": 3}),
        ("stop", {"stop": ["a"]}), ("include_stop_str_in_output", {"stop": ["a"], "include_stop_str_in_output": True}),
        ("penalties", {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}),
        ("min_p top_k", {"min_p": 0.1, "top_k": 5}), ("logit_bias", {"logit_bias": {str(token_ids[0]): 5}}),
        ("ignore_eos min_tokens stop_token_ids", {"ignore_eos": True, "min_tokens": 2,
                                                  "stop_token_ids": [token_ids[0]]}),
        ("user metadata store", {"user": "u-1", "metadata": {"a": "b"}, "store": False}),
        ("service_tier", {"service_tier": "auto"}), ("parallel_tool_calls", {"parallel_tool_calls": False}),
        ("safety_identifier prompt_cache_key", {"safety_identifier": "s-1", "prompt_cache_key": "k"}),
        ("an assistant message as the openai client returns it",
         {"messages": [*chat["messages"], {"role": "assistant", "content": "9", "refusal": None, "annotations": [],
                                           "audio": None, "function_call": None, "tool_calls": None},
                       {"role": "user", "content": "And 5 and 6?"}]}),
        ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
        ("tool_choice none", {"tool_choice": "none"}), ("response_format text", {"response_format": {"type": "text"}}),
        ("response_format json_object", {"response_format": {"type": "json_object"}}),
        ("echo", {"echo": True, "messages": [*chat["messages"], {"role": "assistant", "content": "It is"}],
                  "add_generation_prompt": False, "continue_final_message": True}),
        ("empty messages", {"messages": []}), ("bad role", {"messages": [{"role": "robot", "content": "x"}]}),
        ("wrong model", {"model": "nope"}), ("unknown field", {"foo": 1}),
        ("a vendor's extra field", {"foo_unknown_field": 1, "my_vendor": {"a": 1}}),
        ("vLLM's default skip_special_tokens=true", {"skip_special_tokens": True}),
        ("guided_json (removed from vLLM)", {"guided_json": {"type": "object"}}),
        ("developer role then system", {"messages": [{"role": "developer", "content": "Be brief."},
                                                     {"role": "system", "content": "Answer in one word."},
                                                     *chat["messages"]]}),
        ("stream", stream), ("stream include_usage", {**stream, "stream_options": {"include_usage": True}}),
        ("stream continuous_usage_stats",
         {**stream, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
        ("stream n=2", {**stream, "n": 2}), ("stream logprobs", {**stream, "logprobs": True, "top_logprobs": 2}),
        ("stream stop", {**stream, "stop": ["a"]}),
        ("stream_options without stream", {"stream_options": {"include_usage": True}}),
    ]
    sent = [(f"completions: {name}", "POST", "/v1/completions", _merge(completion, extra)) for name, extra in c]
    sent += [(f"chat: {name}", "POST", "/v1/chat/completions", _merge(chat, extra)) for name, extra in h]
    sent += [
        ("models", "GET", "/v1/models", None), ("model by id", "GET", f"/v1/models/{MODEL_NAME}", None),
        ("health", "GET", "/health", None), ("version", "GET", "/version", None),
        ("metrics: the vllm: families", "GET", "/metrics", None),
        ("tokenize prompt", "POST", "/tokenize", {"model": MODEL_NAME, "prompt": "Hello"}),
        ("tokenize messages", "POST", "/tokenize", {"model": MODEL_NAME, "messages": chat["messages"]}),
        ("detokenize", "POST", "/detokenize", {"model": MODEL_NAME, "tokens": token_ids}),
        ("responses", "POST", "/v1/responses", {"model": MODEL_NAME, "input": "Hi"}),
        ("responses: instructions", "POST", "/v1/responses", {"model": MODEL_NAME, "input": "Hi",
                                                               "instructions": "Answer in one word."}),
        ("responses: a developer input item", "POST", "/v1/responses", {"model": MODEL_NAME, "input": [
            {"role": "developer", "content": "Answer in one word."}, {"role": "user", "content": "Hi"}]}),
        ("responses: stream", "POST", "/v1/responses", {"model": MODEL_NAME, "input": "Hi", "stream": True,
                                                        "max_output_tokens": 5}),
        ("responses: unknown field", "POST", "/v1/responses", {"model": MODEL_NAME, "input": "Hi", "foo": 1}),
        ("tokenize: developer role", "POST", "/tokenize", {"model": MODEL_NAME, "messages": [
            {"role": "developer", "content": "Be brief."}, *chat["messages"]]}),
        ("embeddings", "POST", "/v1/embeddings", {"model": MODEL_NAME, "input": "Hi"}),
        ("no api key", "NOAUTH", "/v1/models", None), ("wrong api key", "BADAUTH", "/v1/models", None),
        ("invalid JSON", "RAW", "/v1/completions", None),
    ]
    return sent


def pooling_requests_to_send() -> list[tuple[str, str, str, dict | None]]:
    """(name, method, path, JSON body) of the pooling routes' requests, for an embedding model."""
    texts = ["The KV cache is split into blocks.", "Bananas are rich in potassium.", "Blocks hold keys and values."]
    query = "What does the KV cache hold?"
    e = {"model": MODEL_NAME}
    sent = [
        ("embeddings", "/v1/embeddings", {**e, "input": texts}),
        ("embeddings base64", "/v1/embeddings", {**e, "input": texts[0], "encoding_format": "base64"}),
        ("embeddings unknown field", "/v1/embeddings", {**e, "input": texts[0], "foo_unknown_field": 1}),
        ("embeddings empty string", "/v1/embeddings", {**e, "input": ""}),
        ("pooling", "/pooling", {**e, "input": texts}),
        ("pooling base64", "/pooling", {**e, "input": texts[0], "encoding_format": "base64"}),
        ("cohere embed", "/v2/embed", {**e, "texts": texts}),
        ("cohere embed every type", "/v2/embed", {**e, "texts": texts,
                                                  "embedding_types": ["float", "base64", "binary", "ubinary"]}),
        ("cohere embed int8", "/v2/embed", {**e, "texts": texts, "embedding_types": ["int8"]}),
        ("cohere embed input_type", "/v2/embed", {**e, "texts": texts, "input_type": "search_query"}),
        ("cohere embed truncate START", "/v2/embed", {**e, "texts": texts, "truncate": "START", "max_tokens": 4}),
        ("cohere embed truncate NONE, too long", "/v2/embed", {**e, "texts": texts, "truncate": "NONE",
                                                               "max_tokens": 4}),
        ("score text_1 against text_2", "/v1/score", {**e, "text_1": query, "text_2": texts}),
        ("score queries and documents", "/v1/score", {**e, "queries": query, "documents": texts}),
        ("score queries and items", "/v1/score", {**e, "queries": query, "items": texts}),
        ("score data_1 and data_2 pairs", "/v1/score", {**e, "data_1": texts[:2], "data_2": texts[1:]}),
        ("score half a pair", "/v1/score", {**e, "queries": query}),
        ("score unprefixed", "/score", {**e, "text_1": query, "text_2": texts}),
        ("rerank", "/v1/rerank", {**e, "query": query, "documents": texts}),
        ("rerank top_n", "/v1/rerank", {**e, "query": query, "documents": texts, "top_n": 1}),
        ("rerank v2", "/v2/rerank", {**e, "query": query, "documents": texts}),
    ]
    return [(f"pooling: {name}", "POST", path, body) for name, path, body in sent]


def _merge(base: dict, extra: dict) -> dict:
    body = {**base, **extra}
    return {k: v for k, v in body.items() if v is not None}


# ---- shapes -----------------------------------------------------------------------------------------
# Objects whose keys are data, not names: the completions API's top_logprobs map token text to a logprob.
DATA_KEYED = {"top_logprobs"}


def shape(value, key: str | None = None) -> dict:
    """A JSON value's shape: its types, and (merged over list items) its keys' shapes."""
    node: dict = {"types": {_type(value)}, "keys": {}, "items": None}
    if isinstance(value, dict) and key in DATA_KEYED:
        for v in value.values():
            node["keys"]["<token>"] = merge(node["keys"].get("<token>"), shape(v))
    elif isinstance(value, dict):
        node["keys"] = {k: shape(v, k) for k, v in value.items()}
    elif isinstance(value, list):
        for item in value:
            node["items"] = merge(node["items"], shape(item, key))
    return node


def merge(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return a or b
    keys = {k: merge(a["keys"].get(k), b["keys"].get(k)) for k in {*a["keys"], *b["keys"]}}
    return {"types": a["types"] | b["types"], "keys": keys, "items": merge(a["items"], b["items"])}


def _type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(value)]


def differences(ref: dict | None, ours: dict | None, path: str = "") -> list[str]:
    """Where ``ours`` differs from ``ref`` (vLLM): missing keys, extra keys, other types."""
    if ref is None or ours is None:
        if ref is ours:
            return []
        if ours is None:
            return [f"{path}: only in vLLM" + (" (null there)" if ref["types"] == {"null"} else "")]
        return [f"{path}: only here"]
    out = []
    if ref["types"] != ours["types"]:
        out.append(f"{path or '.'}: vLLM {'|'.join(sorted(ref['types']))}, here {'|'.join(sorted(ours['types']))}")
    for key in sorted({*ref["keys"], *ours["keys"]}):
        out += differences(ref["keys"].get(key), ours["keys"].get(key), f"{path}.{key}" if path else key)
    if ref["items"] is not None and ours["items"] is not None:
        out += differences(ref["items"], ours["items"], f"{path}[]")
    return out


def response_shape(response: httpx.Response, streamed: bool) -> tuple[dict | None, str]:
    """(shape, kind): JSON body, the union of SSE chunks, or the set of vllm: metric families."""
    text = response.text
    if streamed and response.status_code == 200:
        chunks = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        done = bool(chunks) and chunks[-1] == "[DONE]"
        union = None
        for chunk in chunks[:-1] if done else chunks:
            union = merge(union, shape(json.loads(chunk)))
        return merge(union, shape({"[DONE]": done})), "stream"
    try:
        return shape(response.json()), "json"
    except ValueError:
        families = sorted({line.split()[2] for line in text.splitlines() if line.startswith("# TYPE vllm:")})
        return (shape({f: 0 for f in families}) if families else shape(text[:0])), "text"


# ---- the servers ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def server(cmd: list[str], url: str, env: dict, timeout_s: float):
    """Run ``cmd`` until the ``with`` ends, once ``url/health`` answers 200; yields its process. Its stderr
    goes to a file, not a pipe, so a server that logs every request never blocks on a full pipe."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{cmd[:3]} exited: {log.read().decode(errors='replace')[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[:3]} did not become healthy in {timeout_s} s")
            time.sleep(0.5)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def send(client: httpx.Client, url: str, key: str, method: str, path: str, body: dict | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if method == "NOAUTH":
        return client.get(url + path)
    if method == "BADAUTH":
        return client.get(url + path, headers={"Authorization": "Bearer wrong"})
    if method == "RAW":
        return client.post(url + path, content=b"{not json", headers={**headers, "Content-Type": "application/json"})
    if method == "GET":
        return client.get(url + path, headers=headers)
    return client.post(url + path, json=body, headers=headers)


def compare(vllm: tuple[str, str], ours: tuple[str, str], requests: list[tuple[str, str, str, dict | None]],
            model: str) -> list[dict]:
    rows = []
    with httpx.Client(timeout=120.0) as client:
        for name, method, path, body in requests:
            streamed = bool(body and body.get("stream"))
            answers = [send(client, url, key, method, path, body) for url, key in (vllm, ours)]
            (ref_shape, _), (our_shape, _) = (response_shape(r, streamed) for r in answers)
            same_status = answers[0].status_code == answers[1].status_code
            diff = differences(ref_shape, our_shape) if same_status else []
            scrub = lambda text: text.replace(model, "MODEL")[:300]  # noqa: E731  (no machine paths in results)
            rows.append({"name": name, "vllm_status": answers[0].status_code, "status": answers[1].status_code,
                         "differences": diff, "vllm_body": scrub(answers[0].text), "body": scrub(answers[1].text)})
    return rows


def verdict(row: dict) -> str:
    if row["vllm_status"] != row["status"]:
        return "status"
    if not row["differences"]:
        return "same"
    if all(d.endswith("(null there)") for d in row["differences"]):
        return "nulls"
    return "shape"


def to_markdown(result: dict) -> str:
    rows = result["rows"]
    counts = {v: sum(verdict(r) == v for r in rows) for v in ("same", "nulls", "shape", "status")}
    pooling = f", pooling model `{result['pooling_model']}`" if result.get("pooling_model") else ""
    lines = [f"`{result['run']['command']}` ({result['run']['date']}, vLLM {result['vllm_version']}, "
             f"model `{result['model']}`{pooling})", "",
             f"{len(rows)} requests: {counts['same']} the same status and shape as vLLM, "
             f"{counts['nulls']} the same but for keys vLLM sends as null, "
             f"{counts['shape']} the same status in another shape, {counts['status']} another status.", "",
             "| request | vLLM | stagedserve | shape differences (vLLM's null-valued extras left out) |",
             "|---|---|---|---|"]
    for r in rows:
        if verdict(r) in ("same", "nulls"):
            continue
        diffs = [d for d in r["differences"] if not d.endswith("(null there)")]
        diff = "; ".join(diffs[:4]) + (" ..." if len(diffs) > 4 else "")
        lines.append(f"| {r['name']} | {r['vllm_status']} | {r['status']} | {diff.replace('|', '/') or '-'} |")
    return "\n".join(lines) + "\n"


def start_pair(stack: ExitStack, args: argparse.Namespace, model: str, max_model_len: int,
               vllm: tuple[str | None, str | None], ours: tuple[str | None, str | None], error,
               ) -> tuple[tuple[str, str], tuple[str, str]]:
    """vLLM's server and ``stagedserve serve`` on ``model`` (each unless given by URL), until ``stack`` closes."""
    if not vllm[0]:
        if not args.vllm_python:
            error("give --vllm-python (or --vllm-url)")
        port, key = free_port(), secrets.token_urlsafe(16)
        vllm = (f"http://127.0.0.1:{port}", key)
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        stack.enter_context(server(
            [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--api-key", key,
             "--dtype", "float32", "--max-model-len", str(max_model_len), "--max-num-seqs", "8",
             "--block-size", "32", "--seed", "0"], vllm[0], env, args.startup_timeout))
    if not ours[0]:
        port, key = free_port(), secrets.token_urlsafe(16)
        ours = (f"http://127.0.0.1:{port}", key)
        stack.enter_context(server(
            [sys.executable, "-m", "stage5_server", "serve", model, "--served-model-name", MODEL_NAME,
             "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
             "--max-num-seqs", "8", "--seed", "0", "--log-stats-interval", "0"],
            ours[0], {**os.environ, "STAGEDSERVE_API_KEY": key}, args.startup_timeout))
    return vllm, ours


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", default=os.environ.get("STAGEDSERVE_VLLM_PYTHON"))
    ap.add_argument("--vllm-url")
    ap.add_argument("--vllm-key")
    ap.add_argument("--stagedserve-url")
    ap.add_argument("--stagedserve-key")
    ap.add_argument("--model", default=None, help="a Hugging Face directory both load (default: the tiny llama)")
    ap.add_argument("--pooling-model", default=None,
                    help="an embedding model's directory: a second pair of servers for the pooling routes")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--name", default="api_oracle")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--markdown", default="docs/results/api_oracle.md")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the markdown of a saved result")
    args = ap.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        Path(args.markdown).write_text(to_markdown(result))
        return result
    from course import cached_tiny_model
    from shared import Tokenizer

    model = args.model or str(cached_tiny_model("llama"))
    token_ids = Tokenizer(model).encode("Hello, world! How are you")
    with ExitStack() as stack:
        vllm, ours = start_pair(stack, args, model, 512, (args.vllm_url, args.vllm_key),
                                (args.stagedserve_url, args.stagedserve_key), ap.error)
        version = httpx.get(f"{vllm[0]}/version", timeout=10).json().get("version")
        rows = compare(vllm, ours, requests_to_send(token_ids), model)
    if args.pooling_model:
        with ExitStack() as stack:
            vllm, ours = start_pair(stack, args, args.pooling_model, 256, (None, None), (None, None), ap.error)
            rows += compare(vllm, ours, pooling_requests_to_send(), args.pooling_model)
    # no machine paths in the results
    result = {"run": run_info("benchmarks.api_oracle", argv), "vllm_version": version, "model": Path(model).name,
              "pooling_model": Path(args.pooling_model).name if args.pooling_model else None, "rows": rows}
    write_results(args.name, result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
