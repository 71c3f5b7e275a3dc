"""``make demo``: serve the default model, ask it real questions, then drive the lab's two-phase load.

Starts the server in this process (uvicorn on a thread, a loopback port, a fresh API key) on
SmolLM2-135M-Instruct and talks to it through ``openai.AsyncOpenAI``: a few questions streamed
and marked right or wrong; phase 1, a burst sharing one long system prompt (the prefix cache);
phase 2, two long prompts among short ones (chunked prefill). Then it prints the stats lines,
key numbers from ``/metrics`` and what a 135M-parameter 4-bit model gets wrong.

vLLM: the lab in the course's "vLLM internals" chapter (``vllm serve`` + ``load.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import secrets
import sys
import time
from contextlib import contextmanager

SERVED_MODEL_NAME = "stagedserve-demo"
ENGINE_KWARGS = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256, block_size=16,
                     num_kv_blocks=96)  # 1,536 tokens of KV: tight enough that phase 2 can run out
# (conversation so far, question, words a right reply contains); the last two are ones it gets wrong.
FRANCE = [{"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "The capital of France is Paris."}]
QUESTIONS = [
    ([], "What is the capital of France?", ["Paris"]),
    (FRANCE, "And what is the capital of Germany?", ["Berlin"]),
    ([], "Give me one word that means the opposite of hot.", ["cold"]),
    ([], "Name three primary colors.", ["red"]),
    ([], "What is 12 + 30?", ["42"]),
    ([], "What is the largest planet in the solar system?", ["Jupiter"]),
]
SHOP = ("You answer questions for Wheelhouse, a small bicycle shop in Leeds. The shop opens at nine in the "
        "morning and closes at six in the evening, Monday to Saturday; on Sunday it is closed. It sells city "
        "bikes, folding bikes and children's bikes, and repairs any bicycle, electric ones included. A basic "
        "service costs forty pounds and takes one day; a puncture is fixed while you wait. Rentals cost fifteen "
        "pounds a day, helmet and lock included. The shop is on Mill Street, next to the station. Answer in one "
        "or two short sentences, politely, and never invent prices or services that are not listed here.")
SHOP_QUESTIONS = ["When does the shop open?", "Is the shop open on Sunday?", "How much is a basic service?",
                  "Do you repair electric bikes?", "How much does it cost to rent a bike?",
                  "Where is the shop?", "Do you sell folding bikes?", "How long does a service take?"]
LONG_USER = ("Summarize the following notes ({}). " + "The engine keeps the keys and values of earlier tokens "
             "in fixed-size blocks, and a scheduler decides every step which requests run. " * 12)
WHAT_IT_GETS_WRONG = """\
What a 135M-parameter model quantized to 4 bits gets wrong (greedy decoding, the answers above):
  - it states wrong facts and sums with confidence ("12 + 30 = 32"; the largest planet is "Neptune");
  - it often runs past the answer into filler, so replies are cut by max_tokens;
  - in longer conversations it loses track of who said what.
  On a fixed question set it gets 14 of 28 right (docs/default-model.md, benchmarks/default_model_quality.py).
  The serving engine is the point here: every token is the one transformers computes for this checkpoint."""


class _StatsLines(logging.Handler):
    """Keeps the periodic stats lines so the summary can print them after the run."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Avg prompt throughput"):
            self.lines.append(f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {message}")


@contextmanager
def engine_log_collected():
    """The engine's log goes to a collector (stats lines printed after the run), only warnings to the terminal."""
    log = logging.getLogger("stagedserve")
    lines, console = _StatsLines(), logging.StreamHandler()
    console.setLevel(logging.WARNING)
    saved = log.level, log.propagate
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(lines)
    log.addHandler(console)
    try:
        yield lines
    finally:
        log.removeHandler(lines)
        log.removeHandler(console)
        log.setLevel(saved[0])
        log.propagate = saved[1]


def idle_core_threads() -> int:
    """One torch thread per core idle now (at least one): more threads than free cores wait on descheduled ones."""
    cores = os.cpu_count() or 1
    return max(1, min(cores, cores - round(os.getloadavg()[0])))


def is_right(reply: str, words: list[str]) -> bool:
    return any(word.lower() in reply.lower() for word in words)


async def ask_questions(client, max_tokens: int) -> list[tuple[str, str, bool]]:
    """Each question in turn, its reply printed as the tokens stream in."""
    results = []
    for history, question, words in QUESTIONS:
        for turn in history:
            print(f"{'you' if turn['role'] == 'user' else 'model':>5}: {turn['content']}")
        print(f"  you: {question}\nmodel: ", end="", flush=True)
        stream = await client.chat.completions.create(
            model=SERVED_MODEL_NAME, max_tokens=max_tokens, temperature=0.0, stream=True,
            messages=[*history, {"role": "user", "content": question}])
        pieces = []
        async for chunk in stream:
            text = chunk.choices[0].delta.content if chunk.choices else None
            if text:
                pieces.append(text)
                print(text, end="", flush=True)
        reply = "".join(pieces)
        right = is_right(reply, words)
        print(f"\n       [{'right' if right else f'wrong: expected {words[0]}'}]\n")
        results.append((question, reply, right))
    return results


async def run_load(client, max_tokens: int) -> list[tuple[str, object]]:
    async def ask(user: str, tokens: int, system: str | None = SHOP):
        messages = [{"role": "system", "content": system}] if system else []
        response = await client.chat.completions.create(model=SERVED_MODEL_NAME, max_tokens=tokens,
                                                        temperature=0.0,
                                                        messages=[*messages, {"role": "user", "content": user}])
        return user, response

    t0 = time.monotonic()
    # Phase 1: one request computes the shared system prompt, then a burst reuses it.
    answers = [await ask(SHOP_QUESTIONS[0], max_tokens)]
    answers += await asyncio.gather(*[ask(q, max_tokens) for q in SHOP_QUESTIONS[1:]])
    print(f"phase 1: {len(SHOP_QUESTIONS)} chat requests sharing a {len(SHOP)}-character system prompt "
          f"in {time.monotonic() - t0:.2f} s")
    # Phase 2: two long prompts concurrent with six short ones.
    t0 = time.monotonic()
    answers += await asyncio.gather(ask(LONG_USER.format("A"), max_tokens, None),
                                    ask(LONG_USER.format("B"), max_tokens, None),
                                    *[ask(q, max_tokens // 2) for q in SHOP_QUESTIONS[2:8]])
    print(f"phase 2: 2 long + 6 short chat requests in {time.monotonic() - t0:.2f} s")
    await asyncio.sleep(1.0)  # let one more stats line be logged
    return answers


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' ``histogram_quantile`` over cumulative ``(le, count)`` buckets."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0
    if total == 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def summarize_metrics(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    ttft_buckets = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:time_to_first_token_seconds_bucket":
                ttft_buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name == "vllm:request_success_total":
                key = f"requests_{sample.labels['finished_reason']}"
                values[key] = values.get(key, 0) + sample.value
            else:
                values[sample.name] = values.get(sample.name, 0) + sample.value
    queries = values.get("vllm:prefix_cache_queries_total", 0)
    ttft_count = values.get("vllm:time_to_first_token_seconds_count", 0)
    return {
        "prefix_cache_hit_rate": values.get("vllm:prefix_cache_hits_total", 0) / queries if queries else 0.0,
        "prefix_cache_hits": values.get("vllm:prefix_cache_hits_total", 0),
        "prefix_cache_queries": queries,
        "preemptions": values.get("vllm:num_preemptions_total", 0),
        "prompt_tokens_computed": values.get("vllm:prompt_tokens_total", 0),
        "generation_tokens": values.get("vllm:generation_tokens_total", 0),
        "ttft_p50": histogram_quantile(0.5, ttft_buckets),
        "ttft_mean": values.get("vllm:time_to_first_token_seconds_sum", 0) / ttft_count if ttft_count else math.nan,
        "requests_ok": values.get("requests_stop", 0) + values.get("requests_length", 0),
        "kv_cache_usage": values.get("vllm:kv_cache_usage_perc", 0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stage5_server.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a chat model: directory, .gguf file or name "
                                                       "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per streamed answer (default: 32)")
    parser.add_argument("--log-stats-interval", type=float, default=5.0, help="seconds between stats lines")
    args = parser.parse_args(argv)
    import torch

    threads = torch.get_num_threads()  # the default, or what OMP_NUM_THREADS asked for
    torch.set_num_threads(min(threads, idle_core_threads()))
    try:
        with engine_log_collected() as stats_lines:
            return _run(args, stats_lines)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace, stats_lines: _StatsLines) -> int:
    import httpx
    import torch
    from openai import AsyncOpenAI

    from shared import default_model, resolve_model
    from stage5_server import LLM
    from stage5_server.server import ServerThread, create_app

    started = time.monotonic()
    print("loading the model (the first run converts SmolLM2's GGUF file once, about 20 s on 2 cores) ...", flush=True)
    model = resolve_model(args.model) if args.model else default_model()
    llm = LLM(model=model, **ENGINE_KWARGS)
    api_key = secrets.token_urlsafe(32)
    app = create_app(llm, api_keys={api_key: "demo"}, served_model_name=SERVED_MODEL_NAME,
                     log_stats_interval=args.log_stats_interval)

    async def talk(url: str):
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=300)
        try:
            t0 = time.monotonic()
            results = await ask_questions(client, args.max_tokens)
            print(f"{len(results)} questions, streamed one at a time, in {time.monotonic() - t0:.1f} s\n")
            return results, await run_load(client, 16)
        finally:
            await client.close()

    with ServerThread(app) as server:
        print(f"serving {llm.model_config.family} model from {model} as {SERVED_MODEL_NAME!r} on {server.url} "
              f"(ready after {time.monotonic() - started:.1f} s, {torch.get_num_threads()} torch thread(s); "
              "API key generated for this run)\n")
        results, answers = asyncio.run(talk(server.url))
        headers = {"Authorization": f"Bearer {api_key}"}
        unauthenticated = httpx.get(f"{server.url}/v1/models").status_code
        metrics_text = httpx.get(f"{server.url}/metrics", headers=headers).text
    summary = summarize_metrics(metrics_text)

    print(f"\n{sum(right for _, _, right in results)} of {len(results)} questions answered right.")
    print("\nThree requests of the load, with their token counts:")
    for user, response in [answers[0], answers[3], answers[len(SHOP_QUESTIONS)]]:
        usage = response.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        print(f"  {user[:36]!r:40} -> {response.choices[0].message.content!r:.70}\n"
              f"  {'':40}    [prompt {usage.prompt_tokens} tokens, {cached} from the prefix cache; "
              f"{usage.completion_tokens} generated, finish={response.choices[0].finish_reason}]")
    print("\nStats lines logged during the run:")
    for line in stats_lines.lines or ["(none: the run was shorter than one interval)"]:
        print(f"  {line}")
    print("\nFrom /metrics:")
    print(f"  prefix cache hit rate   {100 * summary['prefix_cache_hit_rate']:.1f}% "
          f"({summary['prefix_cache_hits']:.0f} of {summary['prefix_cache_queries']:.0f} prompt tokens)")
    print(f"  prompt tokens computed  {summary['prompt_tokens_computed']:.0f}")
    print(f"  generation tokens       {summary['generation_tokens']:.0f}")
    print(f"  preemptions             {summary['preemptions']:.0f}")
    print(f"  TTFT p50                {1000 * summary['ttft_p50']:.1f} ms (from histogram buckets; "
          f"mean {1000 * summary['ttft_mean']:.1f} ms)")
    print(f"  requests completed      {summary['requests_ok']:.0f}")
    print(f"  KV cache usage at end   {100 * summary['kv_cache_usage']:.1f}%")
    print(f"\n/v1/models without the API key: HTTP {unauthenticated}")
    if args.model is None:
        print(f"\n{WHAT_IT_GETS_WRONG}")
    print(f"\ndone in {time.monotonic() - started:.1f} s; server shut down")
    ok = summary["requests_ok"] == len(answers) + len(results) and unauthenticated == 401
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
