"""What the server reports: Prometheus metrics under vLLM's names (the stats line: core/stats.py).

Engine state and counters (running, waiting, KV usage, prefix-cache queries and hits,
preemptions, tokens, tokens per step, speculative drafts and accepted tokens) come from a
``SchedulerStats`` snapshot, read at scrape time. Per-request latencies (TTFT, ITL, TPOT, queue,
end-to-end) and sizes are observed into histograms once, when a request finishes, from its
``RequestTimeline``; ``request_phases`` splits its time at the process boundary, so a slow first
token can be placed in the right process.

Every metric carries ``model_name``; each app has its own ``CollectorRegistry``. Buckets are
vLLM's with a few smaller latency bounds in front. With data parallelism the engine numbers
carry an ``engine`` label (one series per rank); with ``PROMETHEUS_MULTIPROC_DIR`` set the
per-request numbers are summed over every API server's files, a dead one's included.

vLLM: ``vllm/v1/metrics/loggers.py`` (``LoggingStatLogger``, ``PrometheusStatLogger``) and
``vllm/v1/metrics/prometheus.py`` (``setup_multiprocess_prometheus``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.metrics import ITERATION_TOKENS_BUCKETS, RequestTimeline, SchedulerStats
from shared.outputs import RequestOutput
from shared.sampling_params import SamplingParams

# vLLM's buckets, with a few smaller ones in front: the course's CPU models answer in milliseconds.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN_LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                         1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                           20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
REQUEST_PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]  # vLLM's
REQUEST_NUM_PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]  # vLLM's


def request_phases(timeline: RequestTimeline) -> dict[str, float | None]:
    """Where a request's time went, in seconds, on each side of the API-server / engine-core boundary:
    ``frontend_in + queue + prefill + frontend_out == server_ttft``. None: not measured."""

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


StatsSource = Callable[[], "SchedulerStats | Mapping[int, SchedulerStats]"]

GAUGES = [
    ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_cache_usage"),
    # weight_sync/: the weight updates the engine has taken, and 0 while awake (1 or 2: its sleep level)
    ("stagedserve:weight_version", "Weight updates the engine core has taken.", "weight_version"),
    ("stagedserve:sleep_level", "0 while serving; the sleep level while asleep.", "sleep_level"),
    # kv_transfer/: the offload tier's slots in use and their number; the blocks received from a prefill instance
    ("stagedserve:kv_offload_used_blocks", "Blocks held in the KV offload tier.", "kv_connector.offload_used_blocks"),
    ("stagedserve:kv_offload_capacity_blocks", "Blocks the KV offload tier holds at most.",
     "kv_connector.offload_capacity_blocks"),
    ("stagedserve:kv_p2p_buffered_blocks", "Blocks received from a prefill instance and kept.",
     "kv_connector.p2p_buffered_blocks"),
]
COUNTERS = [
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
    ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).", "prefix_cache_hits"),
    ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", "num_preemptions"),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "num_prompt_tokens_computed"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "num_generation_tokens"),
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_decoding.num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_decoding.num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_decoding.num_accepted_tokens"),
    ("stagedserve:kv_offload_saved_blocks", "Blocks copied into the KV offload tier.",
     "kv_connector.offload_saved_blocks"),
    ("stagedserve:kv_offload_loaded_blocks", "Blocks copied back from the KV offload tier.",
     "kv_connector.offload_loaded_blocks"),
    ("stagedserve:kv_offload_evicted_blocks", "Blocks the KV offload tier dropped for room.",
     "kv_connector.offload_evicted_blocks"),
    ("stagedserve:kv_p2p_received_blocks", "Blocks received from a prefill instance.",
     "kv_connector.p2p_received_blocks"),
]

# vLLM's splits of numbers above, by a label: (name, doc, label, {label value: field, or None for 0}).
# Nothing here is deferred or read from disk: those are 0. A KV connector's hits are external: the offload
# tier's are "host", a prefill instance's "p2p".
SPLIT = [
    (GaugeMetricFamily, "vllm:num_requests_waiting_by_reason", "Number of requests waiting, by the reason.",
     "reason", {"capacity": "num_waiting", "deferred": None}),
    (CounterMetricFamily, "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source",
     {"local_compute": "num_prompt_tokens_computed", "local_cache_hit": "device_prefix_cache_hits",
      "external_kv_transfer": "kv_connector.external_hit_tokens"}),
    (CounterMetricFamily, "vllm:prompt_tokens_cached_by_source", "Prefix-cache hit tokens by the cache tier that "
     "supplied them.", "source", {"device": "device_prefix_cache_hits", "host": "kv_connector.host_hit_tokens",
                                 "p2p": "kv_connector.p2p_hit_tokens", "disk": None, "external_unspecified": None}),
]


def stat(stats: SchedulerStats, path: str) -> float:
    """A field of a stats snapshot by its dotted path (``spec_decoding.num_drafts``)."""
    for name in path.split("."):
        stats = getattr(stats, name, 0)  # a field another stage's snapshot lacks reads 0
    return stats


class _SchedulerStatsCollector(Collector):
    """Gauges and counters read from the newest ``SchedulerStats`` of each engine core at scrape time."""

    def __init__(self, get_stats: StatsSource, model_name: str, cache_configs: Mapping[int, Mapping[str, str]]):
        self.get_stats = get_stats  # one engine's stats, or {rank: stats}
        self.model_name = model_name
        self.cache_configs = cache_configs  # {rank: vllm:cache_config_info labels}

    def collect(self) -> Iterator[Metric]:
        by_engine = self.get_stats()
        if isinstance(by_engine, SchedulerStats):
            by_engine = {0: by_engine}
        for kind, table in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
            for name, doc, field in table:
                family = kind(name, doc, labels=["model_name", "engine"])
                for rank, stats in sorted(by_engine.items()):
                    family.add_metric([self.model_name, str(rank)], stat(stats, field))
                yield family
        for kind, name, doc, label, fields in SPLIT:
            family = kind(name, doc, labels=["model_name", "engine", label])
            for rank, stats in sorted(by_engine.items()):
                for value, field in fields.items():
                    family.add_metric([self.model_name, str(rank), value], stat(stats, field) if field else 0)
            yield family
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft's token position.",
                                      labels=["model_name", "engine", "position"])
        for rank, stats in sorted(by_engine.items()):
            for position, count in enumerate(stats.spec_decoding.num_accepted_tokens_per_pos):
                per_pos.add_metric([self.model_name, str(rank), str(position)], count)
        yield per_pos
        steps = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                      labels=["model_name", "engine"])
        for rank, stats in sorted(by_engine.items()):
            cumulative = list(accumulate(stats.iteration_tokens_counts))
            buckets = [(str(float(bound)), count) for bound, count in zip(ITERATION_TOKENS_BUCKETS, cumulative)]
            steps.add_metric([self.model_name, str(rank)], [*buckets, ("+Inf", cumulative[-1])],
                             stats.iteration_tokens_sum)
        yield steps
        if self.cache_configs:
            names = sorted(next(iter(self.cache_configs.values())))
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                     labels=[*names, "engine"])
            for rank, config in sorted(self.cache_configs.items()):
                info.add_metric([str(config.get(name)) for name in names] + [str(rank)], 1)
            yield info


class PrometheusStatLogger:
    """The ``/metrics`` registry of one app, an ``engine.StatLoggerBase``; ``render()`` is the text format.
    ``cache_configs``: each engine core's ``vllm:cache_config_info`` labels, by rank."""

    def __init__(self, model_name: str, get_stats: StatsSource, max_model_len: int,
                 cache_configs: Mapping[int, Mapping[str, str]] | None = None):
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerStatsCollector(get_stats, model_name, cache_configs or {}))
        # Multiprocess mode: the per-request metrics live in the shared files (and in no registry);
        # a scrape reads them all back, summed over the API servers.
        self.multiprocess = "PROMETHEUS_MULTIPROC_DIR" in os.environ
        own = None if self.multiprocess else self.registry
        if self.multiprocess:
            multiprocess.MultiProcessCollector(self.registry)
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: list) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=own).labels(model_name)

        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       labels + ["finished_reason"], registry=own)
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_LATENCY_BUCKETS)
        # vLLM 0.32's name, and the earlier one that its Grafana dashboard still reads.
        self.tpots = [histogram(name, "Histogram of time per output token in seconds.", TOKEN_LATENCY_BUCKETS)
                      for name in ("vllm:request_time_per_output_token_seconds", "vllm:time_per_output_token_seconds")]
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
        self.max_tokens = histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                    token_buckets)
        self.prefill_kv_computed = histogram("vllm:request_prefill_kv_computed_tokens",
                                             "Histogram of new KV tokens computed during prefill (excluding cached "
                                             "tokens).", token_buckets)
        self.num_preemptions = histogram("vllm:request_num_preemptions",
                                         "Histogram of the number of times a request was preempted.",
                                         REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.",
                                               token_buckets)

    def record_finished(self, output: RequestOutput, params: SamplingParams | None = None) -> None:
        """One engine request finished (a sample of a parent request when ``n`` > 1)."""
        completion = output.outputs[0]
        self.request_success.labels(self.model_name, completion.finish_reason or "unknown").inc()
        num_prompt = len(output.prompt_token_ids)
        self.prompt_tokens.observe(num_prompt)
        self.generation_tokens.observe(len(completion.token_ids))
        self.prefill_kv_computed.observe(num_prompt - min(output.num_cached_tokens, num_prompt))
        self.num_preemptions.observe(output.num_preemptions)
        if params is not None:
            limit = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
            self.max_tokens.observe(min(limit, self.max_model_len - num_prompt))
        timeline = output.timeline
        for value, histograms in ((timeline.ttft, [self.ttft]), (timeline.tpot, self.tpots),
                                  (timeline.e2e, [self.e2e])):
            if value is not None:
                for histogram in histograms:
                    histogram.observe(max(value, 0.0))
        phases = request_phases(timeline)
        for name, histogram in self.phases.items():
            if phases[name] is not None:
                histogram.observe(phases[name])
        for gap in timeline.itls:
            self.itl.observe(gap)

    def record_parent_finished(self, n: int, num_tokens: list[int]) -> None:
        """All ``n`` samples of one prompt finished (``num_tokens``: their lengths): its ``n`` and its longest
        sample, as vLLM's ``ParentRequest``."""
        self.n.observe(n)
        self.max_generation_tokens.observe(max(num_tokens, default=0))

    def record_aborted(self, reason: str) -> None:
        """An aborted (client gone) or failed (engine error) request: counted, not timed."""
        self.request_success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
