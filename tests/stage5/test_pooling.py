"""The pooling runner on all-MiniLM-L6-v2: vectors within 1e-5 of sentence-transformers' own ``encode``
(and hidden states of transformers' ``BertModel``) in float32, batched and one at a time; long inputs
refused or truncated as vLLM does; a decoder pooling its last token over chunked prefill; the routes,
their shapes and their 400s."""

from __future__ import annotations

import base64
import os

import numpy as np
import pytest
import requests
import torch

from stage5_server import LLM
from stage5_server.config.model import is_encoder, resolve_model
from stage5_server.server import create_app
from tests.stage5.server_fixtures import auth, running_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
KEY = "test-key-pooling"
MODEL = "all-minilm-l6-v2"
SENTENCES = ["The cat sits on the mat.", "A man is playing a guitar.", "Paris is the capital of France.",
             "Paged attention stores the KV cache in fixed-size blocks.", "hello", "Ünïcödé and emoji 🚀 too!",
             "A much longer sentence " * 20]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return resolve_model(MODEL)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", max_num_seqs=8, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def reference(model_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(model_dir, device="cpu")


def test_the_named_embedding_model_resolves_to_a_bert_checkpoint_that_pools(llm):
    assert llm.config.runner == "pooling" and is_encoder(llm.config.model_config)
    assert (llm.config.pooler.pooling_type, llm.config.pooler.normalize) == ("MEAN", True)
    assert llm.max_model_len == 256  # sentence-transformers' max_seq_length


@pytest.mark.slow
def test_bert_hidden_states_match_transformers_bert_model(llm, model_dir):
    from transformers import AutoTokenizer, BertModel

    from stage5_server.pooling.bert import load_bert

    model, _ = load_bert(model_dir)
    reference = BertModel.from_pretrained(model_dir).eval()
    batch = AutoTokenizer.from_pretrained(model_dir)(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
    ours = model(batch["input_ids"], batch["attention_mask"].sum(1))
    mask = batch["attention_mask"].bool()
    assert (ours[mask] - expected[mask]).abs().max() < 1e-5


@pytest.mark.slow
def test_embeddings_match_sentence_transformers_batched_and_one_at_a_time(llm, reference):
    expected = reference.encode(SENTENCES, convert_to_tensor=True)
    batched = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES)])
    single = torch.tensor([llm.embed(s)[0].outputs.embedding for s in SENTENCES])
    assert batched.shape == (len(SENTENCES), 384)
    assert (batched - expected).abs().max() < 1e-5
    assert (single - expected).abs().max() < 1e-5


@pytest.mark.slow
def test_a_long_input_is_refused_or_truncated_to_max_model_len_as_sentence_transformers_does(llm, reference):
    long_text = "tokens " * 400
    with pytest.raises(ValueError, match="maximum context length is 256"):
        llm.embed(long_text)
    truncated = torch.tensor(llm.embed(long_text, truncate_prompt_tokens=-1)[0].outputs.embedding)
    expected = reference.encode([long_text], convert_to_tensor=True)[0]  # it truncates to max_seq_length
    assert (truncated - expected).abs().max() < 1e-5


@pytest.mark.slow
def test_score_is_the_cosine_similarity_of_the_embeddings(llm):
    scores = [o.outputs.score for o in llm.score("A cat on a mat", SENTENCES[:3])]
    a = torch.tensor(llm.embed("A cat on a mat")[0].outputs.embedding)
    b = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES[:3])])
    assert np.allclose(scores, torch.nn.functional.cosine_similarity(a[None], b).tolist(), atol=1e-6)
    assert scores[0] == max(scores)


def test_a_pooling_model_refuses_to_generate_and_its_kv_blocks_are_free_after_each_batch(llm):
    with pytest.raises(ValueError, match="pooling runner"):
        llm.generate("hello")
    llm.embed(SENTENCES[:3])
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv_cache_usage() == 0


def test_a_generating_model_refuses_embed(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64, num_kv_blocks=16, block_size=16)
    with pytest.raises(ValueError, match="only supported for pooling models"):
        llm.embed("hello")


def test_a_decoder_pools_its_last_token_over_chunked_prefill(tiny_llama):

    llm = LLM(str(tiny_llama), convert="embed", dtype="float32", max_model_len=128, num_kv_blocks=32,
              block_size=16, max_num_batched_tokens=16)  # a 40-token prompt takes three steps
    prompt = list(range(3, 43))
    vector = torch.tensor(llm.embed(prompt)[0].outputs.embedding)
    from transformers import AutoModel

    with torch.no_grad():
        hidden = AutoModel.from_pretrained(str(tiny_llama)).eval()(torch.tensor([prompt])).last_hidden_state[0, -1]
    assert (vector - torch.nn.functional.normalize(hidden, dim=-1)).abs().max() < 1e-5
    assert llm.engine.kv_cache_usage() == 0


@pytest.fixture(scope="module")
def server(model_dir):  # an engine of its own: the server's thread drives it, the offline tests drive ``llm``
    app = create_app(LLM(model_dir, dtype="float32", max_num_seqs=8), api_keys=[KEY], served_model_name=MODEL,
                     log_stats_interval=None)
    with running_server(app) as running:
        yield running.url


def post(server, path, body, key=KEY):
    return requests.post(f"{server}{path}", json=body, headers=auth(key), timeout=60)


def test_embeddings_route_takes_a_string_strings_and_token_ids_in_float_and_base64(server, llm):
    expected = [o.outputs.embedding for o in llm.embed(["hello world", "good night"])]
    body = post(server, "/v1/embeddings", {"model": MODEL, "input": ["hello world", "good night"]}).json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1]
    assert np.allclose([d["embedding"] for d in body["data"]], expected, atol=1e-6)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    ids = llm.tokenizer.encode("hello world")
    for given in ("hello world", ids, [ids]):
        one = post(server, "/v1/embeddings", {"model": MODEL, "input": given, "encoding_format": "base64"}).json()
        vector = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), dtype="<f4")
        assert np.allclose(vector, expected[0], atol=1e-6)


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
def test_score_routes_pair_one_text_with_many(server, path):
    body = post(server, path, {"model": MODEL, "text_1": "A cat on a mat", "text_2": SENTENCES[:3]}).json()
    scores = [d["score"] for d in body["data"]]
    assert len(scores) == 3 and scores[0] == max(scores)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_routes_rank_the_relevant_document_first(server, path):
    body = post(server, path, {"model": MODEL, "query": "Which city is France's capital?",
                               "documents": SENTENCES[:4], "top_n": 2}).json()
    assert [r["index"] for r in body["results"]][:1] == [2] and len(body["results"]) == 2
    assert body["results"][0]["document"]["text"] == SENTENCES[2]


@pytest.mark.parametrize("body, param", [
    ({"input": "word " * 400}, "input"),
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": []}, "input"),
    ({"input": [10**9]}, "input"),
])
def test_bad_embedding_requests_are_openai_shaped_400s(server, body, param):
    response = post(server, "/v1/embeddings", {"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_pooling_model_asked_for_tokens_gets_vllms_400(server):
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 400 and "does not support Completions API" in response.json()["error"]["message"]
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "does not support Chat Completions API" in chat.json()["error"]["message"]


def test_every_pooling_route_needs_the_key(server):
    for path in ("/v1/embeddings", "/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank"):
        assert requests.post(f"{server}{path}", json={}, timeout=10).status_code == 401
        assert post(server, path, {}, key="wrong").status_code == 401


def test_a_generating_model_asked_for_embeddings_gets_vllms_400(tiny_llama):
    llm = LLM(str(tiny_llama), max_model_len=64, num_kv_blocks=16, block_size=16)
    app = create_app(llm, api_keys=[KEY], served_model_name="tiny", log_stats_interval=None)
    with running_server(app) as running:
        response = post(running.url, "/v1/embeddings", {"model": "tiny", "input": "hi"})
        assert response.status_code == 400 and response.json()["error"]["message"] == \
            "The model does not support Embeddings API"
        rerank = post(running.url, "/rerank", {"model": "tiny", "query": "q", "documents": ["d"]})
        assert rerank.status_code == 400 and "Rerank" in rerank.json()["error"]["message"]


@pytest.mark.slow
def test_stagedserve_serve_by_name_answers_embeddings_from_its_engine_process(llm, tmp_path):
    """``stagedserve serve all-minilm-l6-v2``, as a user starts it: the engine core in a process of its
    own; the openai client's vectors equal the offline engine's, and the key guards the route."""
    from openai import OpenAI

    from tests.stage5.server_fixtures import serving_or_exited, spawn_serve, stop_serve, wait_until

    expected = [o.outputs.embedding for o in llm.embed(SENTENCES[:3])]
    log = (tmp_path / "serve.log").open("w+")
    process, url = spawn_serve(MODEL, log, "--dtype", "float32", "--api-key", KEY, env={"HF_HUB_OFFLINE": "1"})
    try:
        assert wait_until(serving_or_exited(process, url), timeout=120, interval=0.2) and process.poll() is None
        with OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
            response = client.embeddings.create(model=MODEL, input=SENTENCES[:3])
        assert np.allclose([d.embedding for d in response.data], expected, atol=1e-5)
        assert requests.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "x"}, timeout=10).status_code == 401
    finally:
        assert stop_serve(process, timeout=30) == 0
