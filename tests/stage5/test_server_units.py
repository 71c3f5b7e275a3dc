"""Server pieces that need no engine: the stats line, the metrics registry, the request
models, streaming deltas that never emit a stop string, and the demo's metric summary."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import REGISTRY

from shared import CompletionOutput, RequestOutput, RequestTimeline, SamplingParams
from stage4_prefix_cache import LoggingStatLogger, format_stats_line
from stage5_server.core.messages import EngineCoreOutput
from stage5_server.core.stats import SchedulerStats
from stage5_server.demo import histogram_quantile, summarize_metrics
from stage5_server.engine.output_processor import OutputProcessor, RequestOutputKind
from stage5_server.engine.stream import RequestStream
from stage5_server.server.errors import loc_to_param
from stage5_server.server.metrics import PrometheusStatLogger, build_1_2_5_buckets
from stage5_server.server.protocol import ChatCompletionRequest, CompletionRequest
from stage5_server.server.sse import SSE_DONE, sse


def test_stats_line_reports_interval_throughput_and_engine_state():
    before = SchedulerStats(num_prompt_tokens_computed=100, num_generation_tokens=10)
    after = SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.635, num_preemptions=4,
                           prefix_cache_queries=200, prefix_cache_hits=50, num_prompt_tokens_computed=300,
                           num_generation_tokens=50, num_steps=9)
    assert format_stats_line(before, after, 2.0) == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, KV cache usage: 63.5%, Prefix cache hit rate: 25.0%, Preemptions: 4")


def test_stats_logger_waits_for_its_interval_and_is_quiet_when_idle(caplog):
    stat_logger = LoggingStatLogger(10.0)
    start = stat_logger.last_time
    busy = SchedulerStats(num_running=1, num_generation_tokens=5)
    with caplog.at_level(logging.DEBUG, logger="stagedserve"):
        assert stat_logger.maybe_log(busy, now=start + 5) is None
        assert stat_logger.maybe_log(busy, now=start + 10) is not None
        assert stat_logger.maybe_log(SchedulerStats(num_generation_tokens=5), now=start + 20) is not None
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.DEBUG]
    with pytest.raises(ValueError, match="log_stats_interval"):
        LoggingStatLogger(0)


def test_token_count_buckets_are_1_2_5_up_to_max_model_len():
    assert build_1_2_5_buckets(256) == [1, 2, 5, 10, 20, 50, 100, 200]


def _output(finish: str = "length", token_times=(1.1, 1.2, 1.4)) -> RequestOutput:
    timeline = RequestTimeline(arrival=1.0, first_scheduled=1.05, token_times=list(token_times), finished=1.5)
    completion = CompletionOutput(0, "abc", [1, 2, 3], finish_reason=finish)
    return RequestOutput("r", None, [5, 6], [completion], finished=True, timeline=timeline)


def test_prometheus_logger_uses_its_own_registry_and_vllm_names():
    stats = SchedulerStats(num_running=2, kv_cache_usage=0.5, prefix_cache_queries=10, prefix_cache_hits=4)
    metrics = PrometheusStatLogger("m", lambda: stats, max_model_len=256)
    other = PrometheusStatLogger("m", lambda: stats, max_model_len=256)  # no duplicate-name clash
    metrics.record_finished(_output())
    metrics.record_aborted("abort")
    text = metrics.render().decode()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 2.0' in text
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5' in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 4.0' in text
    assert 'vllm:request_success_total{finished_reason="length",model_name="m"} 1.0' in text
    assert 'vllm:request_success_total{finished_reason="abort",model_name="m"} 1.0' in text
    assert 'vllm:inter_token_latency_seconds_count{model_name="m"} 2.0' in text
    assert 'vllm:request_queue_time_seconds_count{model_name="m"} 1.0' in text
    assert 'finished_reason="length"' not in other.render().decode()  # nothing recorded there
    assert REGISTRY.get_sample_value("vllm:num_requests_running", {"model_name": "m", "engine": "0"}) is None


def test_an_sse_event_is_one_data_line_of_json_then_a_blank_line():
    assert sse({"text": "café", "n": 1}) == 'data: {"text": "café", "n": 1}\n\n'
    assert sse({}) == "data: {}\n\n" and SSE_DONE == "data: [DONE]\n\n"


class CharTokenizer:
    """Token id i is the character chr(i)."""

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(map(chr, token_ids))


def test_stop_strings_are_held_back_while_streaming():
    processor = OutputProcessor(CharTokenizer())
    loop = asyncio.new_event_loop()
    stream = RequestStream("r", loop, delta=True)
    processor.add_request("r", None, [1], SamplingParams(stop=["STOP"]), 0.0, kind=RequestOutputKind.DELTA,
                          queue=stream)

    def step(text: str) -> tuple[list[str], list[str]]:
        out = EngineCoreOutput(request_id="r", new_token_ids=[ord(c) for c in text], new_token_times=[0.0] * len(text),
                               new_logprobs=None, prompt_logprobs=None, finish_reason=None, stop_reason=None,
                               num_cached_tokens=0, num_preemptions=0, queued=None, first_scheduled=None,
                               finished=None)
        processed = processor.process_outputs([out])
        assert not processed.failed, processed.failed  # an output that could not be made fails its request
        return [o.outputs[0].text for _, o in processed.deliveries], processed.reqs_to_abort

    assert step("ab") == ([], [])  # could still be the start of "STOP"
    assert step("cdef") == (["abc"], [])
    assert step("ST") == (["de"], [])
    assert step("OP") == (["f"], ["r"])  # the stop string never went out; the core is told to end the request
    loop.close()


def test_outputs_put_before_an_error_are_handed_out_before_it():
    async def run() -> tuple[RequestOutput, BaseException]:
        stream = RequestStream("r", asyncio.get_running_loop(), delta=True)
        stream.put(RequestOutput("r", None, [0], [CompletionOutput(0, "ab", [1, 2], None)], finished=False))
        stream.put(RuntimeError("the engine failed"))
        first = await stream.get()
        with pytest.raises(RuntimeError, match="the engine failed") as failure:
            await stream.get()
        return first, failure.value

    first, error = asyncio.run(run())
    assert first.outputs[0].text == "ab" and not first.finished and str(error) == "the engine failed"


def test_a_lagging_stream_merges_the_deltas_it_has_not_handed_out():
    async def run() -> RequestOutput:
        stream = RequestStream("r", asyncio.get_running_loop(), delta=True)
        for text, ids, reason in (("ab", [1, 2], None), ("c", [3], "stop")):
            stream.put(RequestOutput("r", None, [0], [CompletionOutput(0, text, ids, reason)],
                                     finished=reason is not None))
        return await stream.get()

    out = asyncio.run(run())
    assert (out.outputs[0].text, out.outputs[0].token_ids, out.finished) == ("abc", [1, 2, 3], True)


def test_request_models_accept_off_values_and_name_the_field_otherwise():
    CompletionRequest.model_validate({"prompt": "x", "n": 1, "echo": False, "presence_penalty": 0.0,
                                      "logit_bias": {}, "best_of": None})
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                                          "response_format": {"type": "text"}, "tool_choice": "none"})
    with pytest.raises(ValueError, match="n"):
        CompletionRequest.model_validate({"prompt": "x", "n": True})  # true is not 1
    with pytest.raises(ValueError, match="suffix is not supported"):
        CompletionRequest.model_validate({"prompt": "x", "suffix": "y"})
    assert loc_to_param(("body", "messages", 0, "content")) == "messages[0].content"


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 2), (0.2, 6), (0.5, 8), (float("inf"), 8)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)


def test_demo_summary_reads_the_hit_rate_and_preemptions_from_metrics():
    stats = SchedulerStats(prefix_cache_queries=200, prefix_cache_hits=150, num_preemptions=3)
    metrics = PrometheusStatLogger("demo", lambda: stats, max_model_len=64)
    metrics.record_finished(_output("stop"))
    summary = summarize_metrics(metrics.render().decode())
    assert summary["prefix_cache_hit_rate"] == 0.75
    assert summary["preemptions"] == 3
    assert summary["requests_ok"] == 1
    assert 0.1 <= summary["ttft_p50"] <= 0.25  # the one TTFT (about 0.1 s) lies in the (0.1, 0.25] bucket


@pytest.mark.slow
def test_demo_runs_end_to_end_and_exits_zero(capsys):
    # tiny-chat instead of the default model, for speed: the questions are not its tasks, the path is the same.
    from stage5_server.demo import main as demo_main

    assert demo_main(["--model", "tiny-chat", "--max-tokens", "4", "--log-stats-interval", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "you: And what is the capital of Germany?" in out and "6 questions, streamed one at a time" in out
    assert "phase 1: 8 chat requests" in out and "phase 2: 2 long + 6 short" in out
    assert "from the prefix cache" in out and "prefix cache hit rate" in out
    assert "/v1/models without the API key: HTTP 401" in out
