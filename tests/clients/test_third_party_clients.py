"""Real client libraries, unchanged, against a live server: the only change a vLLM user makes is
the base URL. langchain-openai (chat and completions models: invoke, stream, batch), litellm
(its ``openai/`` and ``hosted_vllm/`` providers) and lm-eval's ``local-completions`` model on a
log-likelihood, a rolling log-likelihood and a batched generate-until task from local files."""

from __future__ import annotations

import json

import pytest

from stage5_server.server import create_app
from tests.stage5.server_fixtures import make_llm, running_server

KEY = "test-key-clients"
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_llama):
    app = create_app(make_llm(tiny_llama), api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    with running_server(app) as running:
        yield running.url


def test_langchain_chat_and_completions_models_invoke_stream_and_batch(server):
    from langchain_openai import ChatOpenAI, OpenAI

    chat = ChatOpenAI(model=MODEL, base_url=f"{server}/v1", api_key=KEY, max_tokens=4, temperature=0, max_retries=0)
    assert isinstance(chat.invoke("Add 4 and 5.").content, str)
    assert len(list(chat.stream("Add 4 and 5."))) >= 1
    assert len(chat.batch(["Add 4 and 5.", "What is 7 squared?"])) == 2
    completions = OpenAI(model=MODEL, base_url=f"{server}/v1", api_key=KEY, max_tokens=4, temperature=0,
                         max_retries=0)
    assert isinstance(completions.invoke("A scheduler"), str)
    assert len(list(completions.stream("A scheduler"))) >= 1
    batch = completions.batch(["A scheduler", "Blocks of a few tokens", "x"])  # one request, three prompts
    assert len(batch) == 3 and all(isinstance(text, str) for text in batch)


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_providers_complete_and_stream(server, provider):
    import litellm

    messages = [{"role": "user", "content": "Add 4 and 5."}]
    response = litellm.completion(model=f"{provider}/{MODEL}", api_base=f"{server}/v1", api_key=KEY,
                                  messages=messages, max_tokens=4, temperature=0)
    assert response.choices[0].message.content is not None and response.usage.completion_tokens <= 4
    chunks = list(litellm.completion(model=f"{provider}/{MODEL}", api_base=f"{server}/v1", api_key=KEY,
                                     messages=messages, max_tokens=4, temperature=0, stream=True))
    assert chunks


TASKS = {
    "tiny_loglikelihood": {"output_type": "loglikelihood", "doc_to_text": "{{context}}",
                           "doc_to_target": "{{continuation}}", "metric_list": [{"metric": "acc"}]},
    "tiny_rolling": {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                     "metric_list": [{"metric": "word_perplexity"}]},
    "tiny_generate": {"output_type": "generate_until", "doc_to_text": "{{context}}",
                      "doc_to_target": "{{continuation}}", "metric_list": [{"metric": "exact_match"}],
                      "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4, "do_sample": False}},
}
DOCS = [{"context": "A scheduler spends one token budget", "continuation": " per step", "text": "Hello, world!"},
        {"context": "Blocks of a few tokens", "continuation": " waste little", "text": "What is 2 + 3? It is 5."},
        {"context": "The server speaks", "continuation": " the OpenAI API", "text": "Numbers: 0 1 2 3"}]


def test_lm_eval_local_completions_runs_loglikelihood_rolling_and_generate_until_tasks(server, tiny_llama, tmp_path,
                                                                                      monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, spec in TASKS.items():
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", **spec}
        (tmp_path / f"{name}.yaml").write_text(json.dumps(task))  # YAML is a superset of JSON
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model_args = (f"model={MODEL},base_url={server}/v1/completions,tokenizer={tiny_llama},"
                  "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,tokenized_requests=True")
    results = simple_evaluate(model="local-completions", model_args=model_args, tasks=list(TASKS),
                              task_manager=TaskManager(include_path=str(tmp_path)), batch_size=3,
                              log_samples=False)["results"]
    assert set(results) == set(TASKS)
    assert 0 <= results["tiny_loglikelihood"]["acc,none"] <= 1
    assert results["tiny_rolling"]["word_perplexity,none"] > 1
    assert "exact_match,none" in results["tiny_generate"]
