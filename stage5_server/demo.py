"""``make demo``: serve the embedded default model and drive it the way the course's lab does.

Starts the OpenAI-compatible server in this process (uvicorn on a thread, a free
loopback port, a freshly generated API key), then runs the two-phase load from the
vLLM-internals lab through the official ``openai`` client (``AsyncOpenAI``):

- phase 1: a burst of short chat requests that share one long system prompt, so the
  prefix cache serves the shared blocks after the first request has computed them;
- phase 2: two long prompts alongside short ones, so chunked prefill interleaves the
  long prefills with decodes, and a small KV pool may force preemptions.

It prints the questions with the model's answers next to the right ones (the embedded
default model was trained on exactly these kinds of question), the periodic stats lines,
and key numbers scraped from ``/metrics``; then it shuts down and exits 0.

vLLM: the lab in the course's "vLLM internals" chapter (``vllm serve`` + ``load.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import secrets
import sys
import time

from shared.chat_tasks import SYSTEM_PROMPT  # the long system prompt the default model was trained with

LONG_USER = "Summarize the following ({}). " + "data point. " * 60  # ~770 tokens of load (two distinct ones)
SERVED_MODEL_NAME = "stagedserve-demo"
ENGINE_KWARGS = dict(max_model_len=1024, max_num_seqs=16, max_num_batched_tokens=256, block_size=16,
                     num_kv_blocks=96)  # 1,536 tokens of KV: tight enough that phase 2 can run out


class _StatsLines(logging.Handler):
    """Keeps the periodic stats lines so the summary can print them again."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Avg prompt throughput"):
            self.lines.append(f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {message}")


def expected_answer(user: str) -> str | None:
    """The right answer to one of the demo's short questions (None for the long prompts)."""
    words = user.rstrip(".?").split()
    if user.startswith("Add "):
        return str(int(words[1]) + int(words[3]))
    if user.endswith(" squared?"):
        return str(int(words[2]) ** 2)
    return None


async def run_load(base_url: str, api_key: str, max_tokens: int) -> list[tuple[str, object]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=120)

    async def ask(user: str, tokens: int):
        response = await client.chat.completions.create(
            model=SERVED_MODEL_NAME, max_tokens=tokens, temperature=0.0,
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}])
        return user, response

    answers = []
    try:
        t0 = time.monotonic()
        # Phase 1: one request computes the shared system prompt, then a burst of 11 reuses it.
        answers.append(await ask("Add 0 and 1.", max_tokens))
        answers += await asyncio.gather(*[ask(f"Add {i} and {i + 1}.", max_tokens) for i in range(1, 12)])
        print(f"phase 1: 12 chat requests sharing a {len(SYSTEM_PROMPT)}-character system prompt "
              f"in {time.monotonic() - t0:.2f} s")
        await asyncio.sleep(1.0)
        # Phase 2: two long prompts concurrent with eight short ones.
        t0 = time.monotonic()
        answers += await asyncio.gather(ask(LONG_USER.format("A"), 2 * max_tokens),
                                        ask(LONG_USER.format("B"), 2 * max_tokens),
                                        *[ask(f"What is {i} squared?", max_tokens) for i in range(8)])
        print(f"phase 2: 2 long + 8 short chat requests in {time.monotonic() - t0:.2f} s")
        await asyncio.sleep(1.0)  # let one more stats line be logged
    finally:
        await client.close()
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
    parser.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per short answer (default: 16)")
    parser.add_argument("--log-stats-interval", type=float, default=0.5, help="seconds between stats lines")
    args = parser.parse_args(argv)

    import httpx

    from shared import default_model
    from stage5_server import LLM
    from stage5_server.cli.serve import configure_logging
    from stage5_server.server import ServerThread, create_app

    configure_logging()
    stats_lines = _StatsLines()
    logging.getLogger("stagedserve").addHandler(stats_lines)
    started = time.monotonic()
    model = args.model or default_model()
    llm = LLM(model=model, **ENGINE_KWARGS)
    api_key = secrets.token_urlsafe(32)
    app = create_app(llm, api_keys={api_key: "demo"}, served_model_name=SERVED_MODEL_NAME,
                     log_stats_interval=args.log_stats_interval)
    with ServerThread(app) as server:
        print(f"\nserving {model} as {SERVED_MODEL_NAME!r} on {server.url} (API key generated for this run)\n")
        answers = asyncio.run(run_load(server.url, api_key, args.max_tokens))
        headers = {"Authorization": f"Bearer {api_key}"}
        unauthenticated = httpx.get(f"{server.url}/v1/models").status_code
        metrics_text = httpx.get(f"{server.url}/metrics", headers=headers).text
    summary = summarize_metrics(metrics_text)

    print("\nAnswers (greedy), against the right ones:")
    short = [(user, response) for user, response in answers if expected_answer(user) is not None]
    right = 0
    for user, response in short:
        reply, want = response.choices[0].message.content, expected_answer(user)
        right += reply == want
        print(f"  {user:22} -> {reply!r:8} {'right' if reply == want else f'wrong (expected {want!r})'}")
    print(f"  {right} of {len(short)} right")
    print("\nToken counts of three requests (the long one is load for the scheduler, not a task the model knows):")
    for user, response in [answers[0], answers[5], answers[12]]:
        usage = response.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        print(f"  {user[:40]!r:44} -> {response.choices[0].message.content!r:.60} "
              f"[prompt {usage.prompt_tokens} tokens, {cached} from the prefix cache; "
              f"{usage.completion_tokens} generated, finish={response.choices[0].finish_reason}]")
    print("\nStats lines logged during the run:")
    for line in stats_lines.lines or ["  (none: the run was shorter than one interval)"]:
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
    print(f"done in {time.monotonic() - started:.1f} s; server shut down")
    ok = summary["requests_ok"] == len(answers) and unauthenticated == 401
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
