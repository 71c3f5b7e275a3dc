"""Each benchmark's ``main`` runs with tiny settings and writes sane JSON, plot and markdown."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import (
    cpu_gemm,
    kv_fragmentation,
    offline_throughput,
    pipeline_parallel,
    prefix_cache,
    spec_decode,
    step_overhead,
)
from tests.stage5.test_quantization import packed_kind


def _outputs(tmp_path, name):
    return ["--out-dir", str(tmp_path), "--plot", str(tmp_path / f"{name}.png"),
            "--markdown", str(tmp_path / f"{name}.md")]


def _check_files(tmp_path, name):
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert (tmp_path / f"{name}.png").stat().st_size > 0
    md = (tmp_path / f"{name}.md").read_text()
    assert f"python -m benchmarks.{name}" in md
    assert {"date", "machine", "command", "runtime_s", "config"} <= data.keys()
    return data


def test_kv_fragmentation_smoke(tmp_path):
    kv_fragmentation.main(["--max-model-len", "512", "--kv-tokens", "4096", "--num-requests", "64",
                           *_outputs(tmp_path, "kv_fragmentation")])
    data = _check_files(tmp_path, "kv_fragmentation")
    naive = data["stage1"]
    assert naive["requests_fit"] == 4096 // 512
    assert naive["reserved_slots"] == naive["used_slots"] + naive["internal_fragmentation"]
    for row in data["stage2"]:
        assert row["requests_fit"] >= naive["requests_fit"]
        assert row["reserved_slots"] - row["used_slots"] < row["block_size"] * row["requests_fit"]
        assert row["external_fragmentation"] == 0
        assert 0 <= row["waste_pct"] < naive["waste_pct"]
    assert [r["block_size"] for r in data["stage2"]] == [8, 16, 32]


def test_offline_throughput_smoke(tmp_path):
    offline_throughput.main(["--num-requests", "4", "--max-prompt-len", "16", "--max-output-len", "8",
                             "--max-num-seqs", "2", "--engines", "stage1,stage2,stage3,stage4,hf_padded",
                             "--scheduler-requests", "32", *_outputs(tmp_path, "offline_throughput")])
    data = _check_files(tmp_path, "offline_throughput")
    engines = {r["engine"]: r for r in data["engines"]}
    assert {"stage1", "stage2", "stage3", "stage4", "hf_padded"} <= engines.keys()
    for name in ("stage1", "stage2", "stage3", "stage4"):
        assert engines[name]["identical_to_stage1"] == 1.0, name
        assert engines[name]["output_tokens"] == data["config"]["max_output_tokens"]
        assert engines[name]["output_tokens_per_s"] > 0
    assert engines["stage1"]["throughput_vs_stage1"] == 1.0
    assert data["scheduler_overhead"]["num_running"] == 32 and data["scheduler_overhead"]["mean_ms"] > 0
    assert "vllm" in data["skipped"] or "vllm" in engines


def test_prefix_cache_smoke(tmp_path):
    prefix_cache.main(["--system-prompt-len", "48", "--long-prompt-len", "64", "--num-short-phase1", "3",
                       "--num-short-phase2", "2", "--max-tokens", "2", "--block-size", "8",
                       *_outputs(tmp_path, "prefix_cache")])
    data = _check_files(tmp_path, "prefix_cache")
    engines = {r["engine"]: r for r in data["engines"]}
    off, on = engines["stage4_cache_off"]["total"], engines["stage4_cache_on"]["total"]
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
    assert off["prefill_tokens_computed"] == engines["stage3"]["total"]["prefill_tokens_computed"]
    assert data["checks"]["total"]["saved_equals_cached"]
    assert data["checks"]["same_outputs_all_engines"]
    assert on["hit_rate"] > 0 and off["hit_rate"] == 0


@pytest.mark.slow
def test_tensor_parallel_smoke(tmp_path):
    from benchmarks import tensor_parallel

    tensor_parallel.main(["--model", "tiny", "--num-requests", "2", "--prompt-len", "8", "--output-len", "4",
                          "--out-dir", str(tmp_path), "--markdown", str(tmp_path / "tensor_parallel.md")])
    data = json.loads((tmp_path / "tensor_parallel.json").read_text())
    assert data["same_tokens"] is True
    assert [r["tensor_parallel_size"] for r in data["rows"]] == [1, 2]
    assert all(r["output_tokens_per_s"] > 0 for r in data["rows"])
    assert "python -m benchmarks.tensor_parallel" in (tmp_path / "tensor_parallel.md").read_text()


def test_step_overhead_smoke(tmp_path):
    step_overhead.main(["--batch-sizes", "4", "--steps", "3", "--prompt-len", "8", "--out-dir", str(tmp_path),
                        "--markdown", str(tmp_path / "step_overhead.md")])
    data = json.loads((tmp_path / "step_overhead.json").read_text())
    [row] = data["rows"]
    assert row["batch_size"] == 4 and row["steps"] == 3
    assert all(row["p50_ms"][name] > 0 for name in ("schedule", "update", "prepare", "prepare_lists"))
    assert "python -m benchmarks.step_overhead" in (tmp_path / "step_overhead.md").read_text()


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="needs a torch build with MKL")
def test_cpu_gemm_smoke(tmp_path):
    cpu_gemm.main(["--batch-sizes", "4", "--repeats", "2", "--threads", "1", "--out-dir", str(tmp_path),
                   "--markdown", str(tmp_path / "cpu_gemm.md")])
    rows = json.loads((tmp_path / "cpu_gemm.json").read_text())["rows"]
    assert [r["projection"] for r in rows] == ["qkv", "gate_up", "down"]
    assert all(r["linear_gflops"] > 0 and r["packed_gflops"] > 0 and r["packed_bytes_per_weight_byte"] > 1
               for r in rows)
    assert "python -m benchmarks.cpu_gemm" in (tmp_path / "cpu_gemm.md").read_text()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs a torch build with oneDNN")
def test_cpu_decode_products_smoke(tmp_path):
    from benchmarks import cpu_decode_products

    result = cpu_decode_products.main(["--rows", "4", "--layers", "2", "--repeats", "1", "--out-dir", str(tmp_path),
                                       "--markdown", str(tmp_path / "cpu_decode_products.md")])
    (row,) = json.loads((tmp_path / "cpu_decode_products.json").read_text())["rows"]
    flops = 2 * 4 * 2 * sum(n * k for n, k in cpu_decode_products.SHAPES.values())
    assert row["gflop"] == pytest.approx(flops / 1e9) and row["weight_mb"] == pytest.approx(flops / 4 / 1e6)
    assert row["bf16_packed_ms"] > 0 and row["bf16_packed_hot_ms"] > 0 and row["read_ms"] > 0
    # packed where oneDNN packs bfloat16 on this CPU, else the engine's fallback (plain weights), said so
    assert row["bf16_weights"] == packed_kind()
    if cpu_decode_products.int8_available():  # int8 rounds more than bfloat16, and both stay near float32
        assert row["bf16_relative_error"] < row["int8_relative_error"] < 0.05
    md = (tmp_path / "cpu_decode_products.md").read_text()
    assert "python -m benchmarks.cpu_decode_products" in md and result["rows"][0]["rows"] == 4


def test_spec_decode_smoke(tmp_path, tiny_llama):
    spec_decode.main(["--model", str(tiny_llama), "--batch-sizes", "1", "2", "--output-len", "6", "--k", "2",
                      "--out-dir", str(tmp_path), "--markdown", str(tmp_path / "spec_decode.md")])
    data = json.loads((tmp_path / "spec_decode.json").read_text())
    assert {"date", "machine", "command", "runtime_s", "config"} <= data.keys()
    assert "python -m benchmarks.spec_decode" in (tmp_path / "spec_decode.md").read_text()
    rows = data["rows"]
    assert {(r["speculation"], r["workload"], r["batch_size"]) for r in rows} == {
        (s, w, b) for s in ("off", "ngram-fixed", "ngram", "draft") for w in ("copy", "chat") for b in (1, 2)}
    assert all(r["same_tokens_as_off"] and r["tpot_s"] > 0 and r["mean_acceptance_length"] >= 1 for r in rows)
    assert all(r["drafts"] == 0 for r in rows if r["speculation"] == "off")


@pytest.mark.slow
def test_pipeline_parallel_smoke(tmp_path):
    pipeline_parallel.main(["--model", "tiny", "--concurrency", "1", "3", "--prompt-len", "12", "--output-len", "4",
                            *_outputs(tmp_path, "pipeline_parallel")])
    data = _check_files(tmp_path, "pipeline_parallel")
    assert data["same_tokens"] is True
    assert {(r["tensor_parallel_size"], r["pipeline_parallel_size"], r["concurrency"]) for r in data["rows"]} == {
        (tp, pp, c) for tp, pp in pipeline_parallel.LAYOUTS for c in (1, 3)}
    assert all(r["output_tokens_per_s"] > 0 and r["ttft_s"] > 0 for r in data["rows"])
    assert all(len(busy) == 2 and all(0 < b <= 1 for b in busy) for busy in data["busy"].values())


def test_lora_smoke(tmp_path, tiny_llama):
    from benchmarks import lora

    lora.main(["--model", str(tiny_llama), "--batch-size", "4", "--adapters", "0", "1", "2", "--output-len", "4",
               "--rank", "4", "--repeats", "1", "--out-dir", str(tmp_path), "--markdown", str(tmp_path / "lora.md")])
    data = json.loads((tmp_path / "lora.json").read_text())
    assert {"date", "machine", "command", "runtime_s", "config"} <= data.keys()
    assert "python -m benchmarks.lora" in (tmp_path / "lora.md").read_text()
    assert [(r["engine"], r["adapters"]) for r in data["rows"]] == [
        ("base model", 0), ("enable_lora", 0), ("enable_lora", 1), ("enable_lora", 2)]
    assert all(r["step_s"] > 0 and r["output_tokens"] == 4 * 4 for r in data["rows"])


@pytest.mark.slow
def test_cpu_peers_smoke(tmp_path):
    """stage5's rows on the default model with a tiny workload; the peers, not given, are reported skipped."""
    from benchmarks import cpu_peers

    cpu_peers.main(["--rows", "stage5 defaults", "stage5 float32", "--prompt-len", "24", "--output-len", "6",
                    "--num-requests", "3", "--llama-server", "", "--vllm-python", "", "--peak-gemm-size", "512",
                    *_outputs(tmp_path, "cpu_peers")])  # a 4096 GEMM in bfloat16 takes minutes without AVX-512
    data = _check_files(tmp_path, "cpu_peers")
    rows = data["rows"]
    assert set(rows) == {"stage5 defaults", "stage5 float32"} and set(data["skipped"]) == {"llama.cpp", "vLLM"}
    assert rows["stage5 float32"]["dtype"] == "float32" and rows["stage5 float32"]["matching_prefix"] == 6
    assert all(r["batch1_tokens_per_s"] > 0 and r["batch_tokens_per_s"] > 0 and r["of_roofline"] > 0
               and 0 < r["of_machine"] for r in rows.values())
    assert data["ratios"] == {} and set(data["roofline"]) == {"float32", "bfloat16"}
    assert data["machine_peaks"]["read_gb_s"] > 0 and data["machine_peaks"]["gemm_gflops"]["bfloat16"] > 0


def test_the_machine_roofline_takes_the_longer_of_products_and_weights_each_step():
    """Per step: the products' FLOPs at the peak, or the weights read once, whichever takes longer; a step that
    samples nothing reads no LM head."""
    from types import SimpleNamespace

    from benchmarks.machine_roofline import fma_peak_gflops, model_products, products_floor_seconds

    cfg = SimpleNamespace(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    layers, head = model_products(cfg)
    assert layers == 2 * (64 * (4 + 4) * 16 + 64 * 64 + 3 * 64 * 128) and head == 64_000
    peak, bandwidth = 1.0, 1e9  # 1 GFLOP/s, 1 GB/s
    one_token = products_floor_seconds(cfg, [(1, 1)], peak, bandwidth, 2)
    assert one_token == pytest.approx(max(2 * (layers + head) / 1e9, (layers + head) * 2 / 1e9))
    many = products_floor_seconds(cfg, [(4096, 0)], peak, bandwidth, 2)
    assert many == pytest.approx(2 * 4096 * layers / 1e9)  # compute-bound, no LM head
    gflops = fma_peak_gflops(1)
    assert gflops is None or gflops > 1


def test_weight_updates_smoke(tmp_path, tiny_llama):
    from benchmarks import weight_updates

    name = "weight_updates"
    weight_updates.main(["--model", str(tiny_llama), "--repeats", "1", "--rounds", "2", "--batch-size", "2",
                         "--output-len", "4", "--out-dir", str(tmp_path), "--markdown", str(tmp_path / f"{name}.md")])
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert {"date", "machine", "command", "runtime_s", "config"} <= data.keys()
    rows = data["rows"]
    assert rows["update_s"]["in_process"] > 0 and rows["update_s"]["over_gloo"] > 0
    assert [row["way"] for row in rows["loop"]] == ["update the running engine",
                                                   "write a checkpoint, start a new engine"]
    assert all(row["output_tokens_per_s"] > 0 for row in rows["loop"])
    assert "python -m benchmarks.weight_updates" in (tmp_path / f"{name}.md").read_text()


def test_inspector_overhead_smoke(tmp_path, tiny_llama):
    from benchmarks import inspector_overhead

    name = "inspector_overhead"
    inspector_overhead.main(["--model", str(tiny_llama), "--num-requests", "4", "--repeats", "2",
                             "--out-dir", str(tmp_path), "--markdown", str(tmp_path / f"{name}.md")])
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert {"date", "machine", "command", "runtime_s", "config"} <= data.keys()
    assert len(data["off_s"]) == len(data["on_s"]) == len(data["observer_s"]) == 2
    assert data["steps_per_run"] > 0 and data["dropped"] == 0
    assert all(0 < o < t for o, t in zip(data["observer_s"], data["on_s"]))
    assert "python -m benchmarks.inspector_overhead" in (tmp_path / f"{name}.md").read_text()


@pytest.mark.slow
def test_online_peers_smoke(tmp_path, tiny_llama):
    """The rate sweep against stagedserve alone (no vLLM given: stagedserve's own bench serve is the load),
    on the tiny model saved in bfloat16: a row per rate, the figure, the report."""
    from benchmarks import online_peers
    from benchmarks.common import bf16_checkpoint

    model = bf16_checkpoint(tiny_llama)
    assert json.loads((Path(model) / "config.json").read_text())["dtype"] == "bfloat16"
    data = online_peers.main(["--vllm-python", "", "--model", model, "--rates", "2", "8", "--num-prompts", "3",
                              "--input-len", "16", "--output-len", "4", *_outputs(tmp_path, "online_peers")])
    _check_files(tmp_path, "online_peers")
    rows = data["rows"]["stagedserve serve"]
    assert list(rows) == ["2.0", "8.0"] and all(r["completed"] == 3 and r["failed"] == 0 for r in rows.values())
    assert set(data["skipped"]) == {"vLLM's CPU server"} and data["ratios"] == {}


@pytest.mark.slow
def test_served_profile_smoke(tmp_path, tiny_llama):
    """The served engine's steps and the offline engine's on the same arrivals, each step logged."""
    from benchmarks import served_profile

    data = served_profile.main(["--model", str(tiny_llama), "--rates", "4", "--num-prompts", "4", "--input-len", "16",
                                "--output-len", "6", "--out-dir", str(tmp_path),
                                "--markdown", str(tmp_path / "served_profile.md")])
    assert "python -m benchmarks.served_profile" in (tmp_path / "served_profile.md").read_text()
    runs = data["runs"]["4.0"]
    for run in runs.values():
        assert sum(k["steps"] for k in run["kinds"].values()) == run["steps"] > 0
        assert run["kinds"]["with prompt tokens"]["mean_prompt_tokens"] >= 16 and run["tpot_p50_ms"] > 0
    assert set(runs["served"]["cpu_cores"]) == {"API server", "engine core"}
