"""``stagedserve bench serve`` against a real server: uvicorn on 127.0.0.1 over the tiny model.

The report's counts must add up (offered = completed + failed + outstanding) and a request
the server refuses must be counted as failed, never dropped from the denominator.
"""

from __future__ import annotations

import json

import pytest

from stage5_server.bench.cli import main
from stage5_server.llm import LLM
from stage5_server.server import ServerThread, create_app

pytestmark = pytest.mark.slow
API_KEY = "bench-test-key"
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server_url(tiny_llama):
    llm = LLM(model=str(tiny_llama), max_model_len=MAX_MODEL_LEN, max_num_seqs=8, block_size=16,
              max_num_batched_tokens=128, device="cpu", attention_backend="torch")
    app = create_app(llm, api_keys=[API_KEY], log_stats_interval=None)
    with ServerThread(app, host="127.0.0.1") as server:
        yield server.url


def _bench(url: str, tmp_path, *args: str) -> dict:
    out = tmp_path / "result.json"
    rc = main(["serve", "--base-url", url, "--api-key", API_KEY, "--save-result", str(out), *args])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1
    return runs[0]


def _assert_counts_add_up(res: dict) -> dict:
    c = res["counts"]
    assert c["offered"] == c["completed"] + c["failed"] + c["outstanding"]
    assert 0 <= c["passed"] <= c["completed"]
    in_window = [r for r in res["requests"] if r["in_window"]]
    assert len(in_window) == c["offered"]
    return c


def test_bench_serve_report_counts_add_up_and_latencies_are_positive(server_url, tmp_path, capsys):
    res = _bench(server_url, tmp_path, "--dataset", "random", "--num-prompts", "8", "--prompt-len", "16",
                 "--output-len", "6", "--max-output-len", "8", "--request-rate", "50", "--seed", "1",
                 "--warmup-requests", "2", "--slo-ttft-ms", "60000", "--slo-itl-p99-ms", "60000",
                 "--plot", str(tmp_path / "cdf.png"))
    c = _assert_counts_add_up(res)
    assert c == {**c, "offered": 8, "completed": 8, "failed": 0, "outstanding": 0, "warmup": 2, "passed": 8}
    assert res["goodput_req_s"] == pytest.approx(8 / res["window"]["seconds"])
    for key in ("ttft_ms", "e2e_ms", "itl_ms", "tpot_ms"):
        assert res[key]["p50"] > 0 and res[key]["p99"] >= res[key]["p50"]
    assert res["output_token_throughput_tok_s"] > 0
    for r in res["requests"]:
        if r["in_window"]:
            assert r["send_time"] < r["token_times"][0] <= r["token_times"][-1] <= r["end_time"]
            assert 1 <= r["output_tokens"] <= 8
            phases = r["server_timeline"]  # the server's own attribution, inside the client's interval
            assert all(v is not None and v >= 0 for v in phases.values())
            assert phases["server_ttft"] <= r["ttft_s"]
        assert r["send_time"] >= 0
    warm = [r for r in res["requests"] if r["warmup"]]
    assert len(warm) == 2 and not any(r["in_window"] for r in warm)
    assert res["server_phases_ms"]["prefill"]["p50"] > 0
    assert (tmp_path / "cdf.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "Goodput" in out and "server phase (ms)" in out


def test_request_over_max_model_len_is_counted_failed_not_dropped(server_url, tmp_path):
    prompts = [{"prompt": "Hello, world!", "max_tokens": 4}, "What is 2 + 3?",
               {"prompt": "word " * (4 * MAX_MODEL_LEN), "max_tokens": 4}, "Café"]
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts))
    res = _bench(server_url, tmp_path, "--dataset", "json", "--dataset-path", str(path), "--max-tokens", "4")
    c = _assert_counts_add_up(res)
    assert (c["offered"], c["completed"], c["failed"], c["outstanding"]) == (4, 3, 1, 0)
    assert c["passed"] == 3  # no SLO given: every completion passes
    failed = [r for r in res["requests"] if not r["ok"]]
    assert len(failed) == 1 and failed[0]["http_status"] == 400 and "context length" in failed[0]["error"]
    assert res["goodput_req_s"] == pytest.approx(3 / res["window"]["seconds"])


def test_fixed_window_counts_unfinished_requests_as_outstanding(server_url, tmp_path):
    res = _bench(server_url, tmp_path, "--dataset", "random", "--num-prompts", "4", "--prompt-len", "16",
                 "--output-len", "32", "--max-tokens", "32", "--window-seconds", "0.001")
    c = _assert_counts_add_up(res)
    assert c["offered"] >= 1 and c["outstanding"] >= 1 and c["completed"] == 0
    assert res["goodput_req_s"] == 0.0


def test_chat_endpoint_streams_and_counts(server_url, tmp_path):
    res = _bench(server_url, tmp_path, "--endpoint", "chat", "--dataset", "shared-prefix", "--prefix-len", "32",
                 "--num-prompts", "3", "--max-tokens", "3", "--max-concurrency", "2")
    c = _assert_counts_add_up(res)
    assert (c["offered"], c["completed"]) == (3, 3)
    assert res["ttft_ms"]["mean"] > 0
