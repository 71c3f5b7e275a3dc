"""``bench serve``: an async load generator that speaks the OpenAI API and keeps every timeline.

Arrivals are a Poisson process: gaps drawn from ``random.Random(seed).expovariate(rate)``;
``rate=inf`` sends everything at once (a burst), optionally held to ``max_concurrency``
requests in flight. Every request streams (``stream: true`` with
``stream_options.include_usage``) over httpx, and the client timestamps each SSE chunk:

    send time -> first text chunk (TTFT) -> each later text chunk (ITL gaps) -> end of stream

Each request also asks for the server's own timeline (``X-Stagedserve-Timeline: 1``); a
stagedserve server puts it in the final chunk, and the record keeps it as ``server_timeline``
(front-end, queue, prefill, decode and output-path seconds: ``server.metrics.request_phases``).
Other servers ignore the header and the field stays None.

A chunk is the unit the client can see: when the server coalesces several tokens into one
chunk the client experiences one gap, so ITL is measured between chunks (as ``vllm bench
serve`` does), while TPOT divides by the output-token count from the usage chunk.

Warm-up: the first ``warmup_requests`` requests, or those sent in the first
``warmup_seconds``, use prompts from another seed and are not counted. The measured window
starts when warm-up ends; it ends when the last measured request ends, or after exactly
``window_seconds`` (requests unfinished by then are outstanding, and are cancelled).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from shared.metrics import RequestTimeline
from stage5_server.bench.datasets import BenchRequest, DatasetConfig, build_dataset
from stage5_server.bench.goodput import SLO

TIMELINE_HEADER = "X-Stagedserve-Timeline"  # the server's opt-in header (server.serving.TIMELINE_HEADER)


@dataclass
class ServeConfig:
    base_url: str
    api_key: str | None = None
    model: str | None = None  # None: the first model the server lists
    endpoint: str = "completions"  # "completions" | "chat"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    warmup_requests: int = 0
    warmup_seconds: float = 0.0
    window_seconds: float | None = None
    request_timeout: float = 600.0
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True  # synthetic datasets: outputs run to max_tokens, so lengths follow the dataset
    phase_gap_seconds: float = 1.0  # two-phase: pause after phase 1 has drained
    slo: SLO = field(default_factory=SLO)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)

    def validate(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint: must be 'completions' or 'chat', got {self.endpoint!r}")
        if not (self.request_rate > 0):
            raise ValueError(f"request_rate: must be > 0 (inf for a burst), got {self.request_rate!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")
        if self.warmup_requests < 0 or self.warmup_seconds < 0:
            raise ValueError("warmup_requests / warmup_seconds: must be >= 0")
        if self.warmup_seconds > 0 and math.isinf(self.request_rate) and self.max_concurrency is None:
            raise ValueError("warmup_seconds: a burst (request_rate inf) without max_concurrency would send "
                             "unboundedly many warm-up requests; set --max-concurrency or a finite rate")
        if self.window_seconds is not None and self.window_seconds <= 0:
            raise ValueError(f"window_seconds: must be > 0, got {self.window_seconds}")
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout: must be > 0, got {self.request_timeout}")


@dataclass
class RequestRecord:
    """One request's whole timeline, in seconds since the run's start (``time.perf_counter`` based)."""

    index: int
    warmup: bool
    phase: int
    max_tokens: int
    prompt_len: int | None
    send_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # every SSE data chunk with a choice
    token_times: list[float] = field(default_factory=list)  # chunks that carried output (the token arrivals)
    end_time: float | None = None  # None: never ended (cancelled when the window closed)
    ok: bool = False
    error: str | None = None
    http_status: int | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    server_timeline: dict[str, float | None] | None = None  # the server's phases, when it reports them

    def timeline(self) -> RequestTimeline:
        return RequestTimeline(arrival=self.send_time, token_times=list(self.token_times), finished=self.end_time)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BenchRun:
    """The raw result of one run at one request rate: every record and the window."""

    config: ServeConfig
    model: str
    records: list[RequestRecord]
    window_start: float
    window_end: float
    started_at: str  # wall-clock ISO date of the start


async def _served_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise ValueError("model: the server lists no model; pass --model")
    return data[0]["id"]


async def _detokenize(client: httpx.AsyncClient, model: str, ids: list[int]) -> str:
    resp = await client.post("/detokenize", json={"model": model, "tokens": ids})
    resp.raise_for_status()
    return resp.json()["prompt"]


def _payload(cfg: ServeConfig, model: str, req: BenchRequest, text: str | None) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": text if text is not None else req.prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = req.prompt
    return "/v1/completions", body


def _error_message(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        return f"HTTP {status}: {err.get('message', err)}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {raw[:200].decode(errors='replace')}"


async def _stream_one(client: httpx.AsyncClient, path: str, body: dict[str, Any], rec: RequestRecord, clock) -> None:
    """Send one streaming request and fill ``rec``; never raises (errors go into the record)."""
    done = False
    finish_time = None
    try:
        async with client.stream("POST", path, json=body) as resp:
            rec.http_status = resp.status_code
            if resp.status_code != 200:
                rec.error = _error_message(resp.status_code, await resp.aread())
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                now = clock()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = f"stream error: {obj['error'].get('message', obj['error'])}"
                    continue
                if obj.get("server_timeline"):
                    rec.server_timeline = obj["server_timeline"]
                if obj.get("usage"):
                    rec.prompt_tokens = obj["usage"].get("prompt_tokens")
                    rec.output_tokens = obj["usage"].get("completion_tokens") or 0
                for choice in obj.get("choices") or []:
                    rec.chunk_times.append(now)
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if text:
                        rec.token_times.append(now)
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
                        finish_time = now
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except (ValueError, KeyError, TypeError) as exc:  # a malformed chunk
        rec.error = f"bad stream chunk: {exc}"
    finally:
        if rec.end_time is None:
            rec.end_time = clock()
    if rec.error is None and not (done and rec.finish_reason):
        rec.error = "stream ended without a finish_reason and [DONE]"
    if rec.error is None:
        if not rec.output_tokens:  # no usage chunk: count the chunks that carried output
            rec.output_tokens = len(rec.token_times)
        if not rec.token_times and rec.output_tokens and finish_time is not None:
            rec.token_times.append(finish_time)  # tokens whose text was empty (e.g. only EOS)
        rec.ok = True


async def run_once(cfg: ServeConfig) -> BenchRun:
    """Run the load once against ``cfg.base_url``; return every record and the measured window."""
    cfg.validate()
    requests = build_dataset(cfg.dataset)
    needs_warmup = cfg.warmup_requests > 0 or cfg.warmup_seconds > 0
    warmup_pool = build_dataset(cfg.dataset, seed=cfg.seed + 1_000_003) if needs_warmup else []
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    headers[TIMELINE_HEADER] = "1"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: never route the benchmark through a proxy from the environment.
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.request_timeout), trust_env=False) as client:
        model = cfg.model or await _served_model(client)
        texts: dict[int, str] = {}
        if cfg.endpoint == "chat":  # token-id prompts become text (not timed); lengths shift slightly
            for r in {id(r): r for r in requests + warmup_pool}.values():
                if isinstance(r.prompt, list):
                    texts[id(r)] = await _detokenize(client, model, r.prompt)
        started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        t0 = time.perf_counter()
        clock = lambda: time.perf_counter() - t0
        records: list[RequestRecord] = []
        measured_tasks: list[asyncio.Task] = []
        all_tasks: list[asyncio.Task] = []
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        window = {"start": cfg.warmup_seconds if cfg.warmup_seconds > 0 else None}
        window_started = asyncio.Event()
        if window["start"] is not None:
            window_started.set()

        async def one(req: BenchRequest, rec: RequestRecord) -> None:
            path, body = _payload(cfg, model, req, texts.get(id(req)))
            try:
                await asyncio.wait_for(_stream_one(client, path, body, rec, clock), cfg.request_timeout)
            except asyncio.TimeoutError:
                rec.error, rec.ok, rec.end_time = f"timeout after {cfg.request_timeout:g} s", False, clock()
            finally:
                if sem:
                    sem.release()

        async def drive() -> None:
            rng = random.Random(cfg.seed)
            next_t = 0.0
            measured = warm = 0
            phase = None
            while measured < len(requests):
                req = requests[measured]
                if phase is not None and req.phase != phase:
                    await asyncio.gather(*measured_tasks)  # two-phase: drain phase 1, then pause
                    await asyncio.sleep(cfg.phase_gap_seconds)
                    next_t = clock()
                delay = next_t - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                if sem:
                    await sem.acquire()
                send = clock()
                is_warmup = (measured == 0 and warm < cfg.warmup_requests) or send < cfg.warmup_seconds
                if is_warmup:
                    req = warmup_pool[warm % len(warmup_pool)]
                    warm += 1
                else:
                    measured += 1
                    phase = req.phase
                    if window["start"] is None:
                        window["start"] = send
                        window_started.set()
                rec = RequestRecord(len(records), is_warmup, req.phase, req.max_tokens, req.prompt_len, send)
                records.append(rec)
                task = asyncio.ensure_future(one(req, rec))
                all_tasks.append(task)
                if not is_warmup:
                    measured_tasks.append(task)
                if not math.isinf(cfg.request_rate):
                    next_t += rng.expovariate(cfg.request_rate)
            await asyncio.gather(*measured_tasks)

        driver = asyncio.ensure_future(drive())
        try:
            if cfg.window_seconds is None:
                await driver
            else:
                started = asyncio.ensure_future(window_started.wait())
                await asyncio.wait({driver, started}, return_when=asyncio.FIRST_COMPLETED)
                started.cancel()
                remaining = window["start"] + cfg.window_seconds - clock() if window["start"] is not None else 0
                await asyncio.wait({driver}, timeout=max(0.0, remaining))
                if driver.done():
                    driver.result()  # re-raise a failure of the driver itself
        finally:
            for task in [driver, *all_tasks]:
                task.cancel()
            await asyncio.gather(driver, *all_tasks, return_exceptions=True)
    for rec in records:  # a cancelled request never ended: it is outstanding, not failed
        if not rec.ok and rec.error is None:
            rec.end_time = None
    measured_recs = [r for r in records if not r.warmup]
    start = window["start"] if window["start"] is not None else 0.0
    if cfg.window_seconds is not None:
        end = start + cfg.window_seconds
    else:
        end = max((r.end_time for r in measured_recs if r.end_time is not None), default=start)
    return BenchRun(cfg, model, records, start, end, started_at)


def run_serve(cfg: ServeConfig) -> BenchRun:
    """Synchronous wrapper (one event loop per run)."""
    return asyncio.run(run_once(cfg))
