"""What the server reports: Prometheus metrics under vLLM's names (the periodic stats line is stage4's).

Two kinds of numbers. Engine state (running, waiting, KV usage) and engine counters
(prefix-cache queries and hits, preemptions, prompt and generation tokens) come from a
``SchedulerStats`` snapshot and are read when ``/metrics`` is scraped. Per-request
latencies (TTFT, ITL, TPOT, queue time, end-to-end) and sizes are observed into
histograms once, when a request finishes, from its ``RequestTimeline``.

Each finished request's time is also split at the boundary between the API server and
the engine core (``request_phases``), so a slow first token can be placed in the right
process: ``frontend_in`` (HTTP parsing, tokenization, the hand-off to the core),
``queue``, ``prefill``, ``decode`` (engine core), ``frontend_out`` (from the core sampling
the first token to its detokenized output reaching the request's stream). The core
phases use vLLM's histogram names; the two front-end phases are this server's own.

Every metric carries a ``model_name`` label, and each app has its own
``CollectorRegistry`` (never prometheus-client's global one), so two apps in one process
do not collide. Counters are exposed with the ``_total`` suffix, as vLLM's are.

vLLM: ``vllm/v1/metrics/loggers.py`` (``LoggingStatLogger``, ``PrometheusStatLogger``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.metrics import RequestTimeline, SchedulerStats
from shared.outputs import RequestOutput

# vLLM's buckets, with a few smaller ones in front: the course's CPU models answer in milliseconds.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                         1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                           20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def request_phases(timeline: RequestTimeline) -> dict[str, float | None]:
    """Where a request's time went, in seconds, by side of the API-server / engine-core boundary.

    ``frontend_in + queue + prefill + frontend_out == server_ttft``; the time a client sees
    beyond ``server_ttft`` is the event loop, HTTP and the network. None: not measured.
    """

    def between(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else max(end - start, 0.0)

    t = timeline
    queued = t.queued if t.queued is not None else t.arrival
    first_token = t.token_times[0] if t.token_times else None
    last_token = t.token_times[-1] if t.token_times else None
    return {"frontend_in": between(t.received, queued), "queue": between(queued, t.first_scheduled),
            "prefill": between(t.first_scheduled, first_token), "decode": between(first_token, last_token),
            "inference": between(t.first_scheduled, last_token), "frontend_out": between(first_token,
                                                                                         t.first_delivered),
            "server_ttft": between(t.received, t.first_delivered)}


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class _SchedulerStatsCollector(Collector):
    """Gauges and counters read from the newest ``SchedulerStats`` at scrape time."""

    def __init__(self, get_stats: Callable[[], SchedulerStats], model_name: str):
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        s = self.get_stats()
        gauges = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
        ]
        counters = [
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_cache_hits),
            ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.num_prompt_tokens_computed),
            ("vllm:generation_tokens", "Number of generation tokens processed.", s.num_generation_tokens),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class PrometheusStatLogger:
    """The ``/metrics`` registry of one app, an ``engine.StatLogger``. ``render()`` is the Prometheus text format."""

    def __init__(self, model_name: str, get_stats: Callable[[], SchedulerStats], max_model_len: int):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerStatsCollector(get_stats, model_name))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: list) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       labels + ["finished_reason"], registry=self.registry)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (per request).", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.phases = {
            "queue": histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS),
            "prefill": histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS),
            "decode": histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS),
            "inference": histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS),
            "frontend_in": histogram("stagedserve:request_frontend_in_time_seconds",
                                     "API server: request received to engine core taking it in (parse, tokenize, "
                                     "hand-off).", TTFT_BUCKETS),
            "frontend_out": histogram("stagedserve:request_frontend_out_time_seconds",
                                      "API server: first token sampled by the engine core to its detokenized "
                                      "output reaching the request's stream.", TTFT_BUCKETS),
        }
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                       token_buckets)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           token_buckets)

    def record_finished(self, output: RequestOutput) -> None:
        completion = output.outputs[0]
        self.request_success.labels(self.model_name, completion.finish_reason or "unknown").inc()
        self.prompt_tokens.observe(len(output.prompt_token_ids))
        self.generation_tokens.observe(len(completion.token_ids))
        timeline = output.timeline
        for value, histogram in ((timeline.ttft, self.ttft), (timeline.tpot, self.tpot), (timeline.e2e, self.e2e)):
            if value is not None:
                histogram.observe(max(value, 0.0))
        phases = request_phases(timeline)
        for name, histogram in self.phases.items():
            if phases[name] is not None:
                histogram.observe(phases[name])
        for gap in timeline.itls:
            self.itl.observe(gap)

    def record_aborted(self, reason: str) -> None:
        """An aborted (client gone) or failed (engine error) request: counted, not timed."""
        self.request_success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
