"""The ``stagedserve`` CLI: vLLM's flag names, the engine flags made from the engine argument table and
only those given reach the engine, the server's options as one ``ServerConfig``, API keys from flags or
the environment, ``make-tiny-model``, the ``bench`` hook, and a real ``serve``."""

from __future__ import annotations

import argparse
import json
import pickle
import re
import sys
import types
from dataclasses import replace

import httpx
import pytest
from fastapi.testclient import TestClient

from shared.llm_base import COMMON_ARGS
from stage4_prefix_cache.llm import PREFIX_CACHING_ARGS
from stage5_server.arg_types import parse_size
from stage5_server.cli import main, make_parser
from stage5_server.cli.options import API_KEY_ENV, resolve_api_keys, server_config_from
from stage5_server.cli.serve import build_engine_kwargs, server_batch_defaults
from stage5_server.config import ENGINE_ARG_TABLE, ENGINE_ARGS, SERVER_ENGINE_ARGS
from stage5_server.engine.thread_client import AsyncLLM
from stage5_server.server import ServerConfig, create_app
from stage5_server.server.chat_options import ChatOptions
from stage5_server.server.limits import DEFAULT_MAX_BODY_BYTES, RequestLimits
from stage5_server.server.media import MediaOptions
from tests.stage5.server_fixtures import auth, make_llm, serving_or_exited, spawn_serve, stop_serve, wait_until

# Stage 5's engine arguments and their defaults as they were before the table (and those added since): it
# must keep them all.
ENGINE_ARGS_BEFORE_THE_TABLE = {
    "tokenizer": None, "seed": 0, "dtype": "auto", "device": None, "max_model_len": None, "max_num_seqs": 16,
    "kv_cache_memory": None, "block_size": 16, "num_kv_blocks": None, "block_shuffle_seed": None,
    "max_num_batched_tokens": 512, "max_num_active_seqs": None, "enable_chunked_prefill": True,
    "scheduling_policy": "fcfs", "log_stats_interval": None, "enable_prefix_caching": True,
    "prefix_caching_hash_algo": "sha256", "attention_backend": None, "gpu_memory_utilization": 0.9,
    "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "distributed_executor_backend": None,
    "distributed_interface": None, "enforce_eager": None, "cpu_threads": None, "speculative_config": None,
    "runner": "auto", "convert": "auto", "quantization": None, "prepack_linear": None, "enable_lora": False,
    "max_loras": 1, "max_lora_rank": 16, "kv_offloading_size": None, "kv_transfer_config": None,
    "compile_in_background": None, "enable_weight_sync": False, "enable_inspector": False}
# Engine arguments without a serve flag: a server flag sets log_stats_interval; the others are no use to a server.
NO_SERVE_FLAG = {"block_shuffle_seed", "log_stats_interval", "prefix_caching_hash_algo", "scheduling_policy"}


def parse(*argv: str):
    return make_parser().parse_args(list(argv))


def serve_parser() -> argparse.ArgumentParser:
    subparsers = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["serve"]


def test_serve_defaults_bind_loopback_and_pass_no_engine_arguments():
    args = parse("serve")
    assert args.model is None
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert build_engine_kwargs(args) == {}
    assert args.api_key is None and not args.trust_client_cache_salt and not args.metrics_public


def test_serve_passes_exactly_the_engine_flags_given():
    args = parse("serve", "/models/m", "--max-model-len", "2048", "--max-num-seqs", "8",
                 "--max-num-batched-tokens", "512", "--block-size", "32", "--no-enable-prefix-caching",
                 "--gpu-memory-utilization", "0.8", "--kv-cache-memory", "1GiB", "--num-kv-blocks", "100",
                 "--dtype", "bfloat16", "--device", "cuda:1", "--attention-backend", "triton", "--seed", "7",
                 "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--distributed-interface", "lo",
                 "--distributed-executor-backend", "ray", "--no-enforce-eager",
                 "--cpu-threads", "3", "--served-model-name", "m", "--log-stats-interval", "5", "--metrics-public",
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}',
                 "--runner", "generate", "--convert", "none", "--quantization", "int8", "--no-prepack-linear",
                 "--enable-lora", "--max-loras", "4", "--max-lora-rank", "32", "--lora-modules", "a=/adapters/a",
                 "b=/adapters/b")
    assert args.model == "/models/m"
    assert args.lora_modules == ["a=/adapters/a", "b=/adapters/b"]  # a server flag, not the engine's
    assert build_engine_kwargs(args) == {
        "max_model_len": 2048, "max_num_seqs": 8, "max_num_batched_tokens": 512, "block_size": 32,
        "enable_prefix_caching": False, "gpu_memory_utilization": 0.8, "kv_cache_memory": 1 << 30,
        "num_kv_blocks": 100, "dtype": "bfloat16", "device": "cuda:1", "attention_backend": "triton", "seed": 7,
        "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "distributed_interface": "lo",
        "distributed_executor_backend": "ray", "enforce_eager": False, "cpu_threads": 3,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 4}, "runner": "generate",
        "convert": "none", "quantization": "int8", "prepack_linear": False, "enable_lora": True, "max_loras": 4,
        "max_lora_rank": 32}
    assert set(build_engine_kwargs(args)) == {arg.name for arg in ENGINE_ARG_TABLE if arg.cli} - {
        "tokenizer", "max_num_active_seqs", "enable_chunked_prefill", "kv_offloading_size",
        "kv_transfer_config", "compile_in_background", "enable_weight_sync",
        "enable_inspector"}  # the flags added since: below
    assert build_engine_kwargs(parse("serve", "--enable-inspector")) == {"enable_inspector": True}
    assert build_engine_kwargs(parse("serve", "--no-compile-in-background")) == {"compile_in_background": False}
    assert build_engine_kwargs(parse("serve", "--enable-prefix-caching")) == {"enable_prefix_caching": True}
    transfer = '{"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": ' \
               '{"kv_port": 14579}}'
    assert build_engine_kwargs(parse("serve", "--kv-offloading-size", "1.5")) == {"kv_offloading_size": 1.5}
    assert build_engine_kwargs(parse("serve", "--kv-transfer-config", transfer)) == {
        "kv_transfer_config": {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
                               "kv_connector_extra_config": {"kv_port": 14579}}}
    assert build_engine_kwargs(parse("serve", "--enable-weight-sync")) == {"enable_weight_sync": True}
    assert build_engine_kwargs(parse("serve", "--enable-dev-routes")) == {"enable_weight_sync": True}
    assert build_engine_kwargs(parse("serve", "--enable-dev-routes", "--no-enable-weight-sync")) == {
        "enable_weight_sync": False}
    assert build_engine_kwargs(parse("serve", "--tokenizer", "/tokenizers/t", "--max-num-active-seqs", "4",
                                     "--no-enable-chunked-prefill")) == {
        "max_num_active_seqs": 4, "enable_chunked_prefill": False, "tokenizer": "/tokenizers/t"}


def test_the_engine_table_keeps_every_engine_argument_and_each_earlier_stages_default():
    assert ENGINE_ARGS == ENGINE_ARGS_BEFORE_THE_TABLE
    assert SERVER_ENGINE_ARGS == {k: v for k, v in ENGINE_ARGS_BEFORE_THE_TABLE.items() if k not in COMMON_ARGS}
    earlier = {**COMMON_ARGS, **PREFIX_CACHING_ARGS}
    assert {name: ENGINE_ARGS[name] for name in earlier} == earlier
    assert len({arg.name for arg in ENGINE_ARG_TABLE}) == len(ENGINE_ARG_TABLE)


def test_every_engine_table_entry_is_a_serve_flag_and_every_engine_flag_an_engine_argument():
    [group] = [g for g in serve_parser()._action_groups if g.title.startswith("engine")]
    flags = {action.dest: action for action in group._group_actions}
    assert {arg.name for arg in ENGINE_ARG_TABLE if not arg.cli} == NO_SERVE_FLAG
    assert set(flags) == set(ENGINE_ARGS) - NO_SERVE_FLAG  # EngineConfig.create accepts exactly ENGINE_ARGS
    for arg in ENGINE_ARG_TABLE:
        if not arg.cli:
            continue
        action = flags[arg.name]
        negative = ["--no-" + arg.flag[2:]] if arg.is_flag else []
        assert action.option_strings == [arg.flag, *negative, *arg.aliases]
        assert isinstance(action, argparse.BooleanOptionalAction) == arg.is_flag
        assert (action.default, action.type, action.help) == (None, arg.type, arg.help)  # None: not passed
        assert action.choices == arg.choices
    assert flags["quantization"].option_strings == ["--quantization", "-q"]
    assert flags["tensor_parallel_size"].option_strings == ["--tensor-parallel-size", "-tp"]
    assert flags["pipeline_parallel_size"].option_strings == ["--pipeline-parallel-size", "-pp"]


def test_log_stats_interval_and_lora_modules_stay_server_flags():
    args = parse("serve", "--log-stats-interval", "5", "--lora-modules", "a=/adapters/a")
    assert build_engine_kwargs(args) == {}
    assert (args.log_stats_interval, parse("serve").log_stats_interval) == (5.0, 10.0)
    assert server_config_from(args).log_stats_interval == 5.0
    assert server_config_from(parse("serve", "--log-stats-interval", "0")).log_stats_interval is None  # off


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-model-len", "abc"], "argument --max-model-len: not an integer: 'abc'"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be an integer >= 1, got '0'"),
    (["-tp", "0"], "argument --tensor-parallel-size/-tp: must be an integer >= 1, got '0'"),
    (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be in (0, 1], got '1.5'"),
    (["--kv-cache-memory", "lots"], "argument --kv-cache-memory: not a size: 'lots' (e.g. 1073741824, 512MiB, 2GiB)"),
    (["-q", "awq"], "argument --quantization/-q: invalid choice: 'awq'"),
    (["--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
    (["--speculative-config", "[1]"], "argument --speculative-config: not a JSON object: '[1]'"),
    (["--enable-lora=yes"], "argument --enable-lora/--no-enable-lora: ignored explicit argument 'yes'"),
])
def test_a_bad_engine_flag_is_refused_with_its_parsers_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", *argv])
    assert exc.value.code == 2
    assert f"stagedserve serve: error: {message}" in capsys.readouterr().err


def test_a_server_gets_vllms_batch_limits_for_its_device_unless_the_flags_set_them():
    assert server_batch_defaults({"device": "cpu"}) == {"max_num_seqs": 128, "max_num_batched_tokens": 2048}
    assert server_batch_defaults({"device": "cpu", "max_num_seqs": 8}) == {"max_num_batched_tokens": 2048}
    assert server_batch_defaults({"device": "cpu", "tensor_parallel_size": 2, "pipeline_parallel_size": 2}) == {
        "max_num_seqs": 512, "max_num_batched_tokens": 8192}  # per rank on a CPU, as vLLM sizes it
    assert server_batch_defaults({"device": "cuda:1", "tensor_parallel_size": 2}) == {
        "max_num_seqs": 256, "max_num_batched_tokens": 2048}
    assert server_batch_defaults({"device": "cpu", "max_num_seqs": 8, "max_num_batched_tokens": 64}) == {}


@pytest.mark.parametrize("argv", [["serve", "--max-model-len", "abc"], ["serve", "--max-num-seqs", "0"],
                                  ["serve", "--gpu-memory-utilization", "1.5"], ["serve", "--port", "70000"],
                                  ["serve", "--dtype", "int3"], ["serve", "--kv-cache-memory", "lots"],
                                  ["serve", "--unknown-flag"], ["serve", "--speculative-config", "{ngram"],
                                  ["serve", "--speculative-config", "[1]"], []])
def test_bad_arguments_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_parse_size_understands_units():
    assert parse_size("1048576") == 1 << 20
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("2G") == 2 << 30
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("1GB") == 10**9


def test_api_keys_come_from_flags_or_else_the_environment():
    assert resolve_api_keys(None, None) is None
    assert resolve_api_keys(["a", "b group=team"], "ignored") == {"a": None, "b": "team"}
    assert resolve_api_keys(None, "x group=g1, y group=g1 ,z") == {"x": "g1", "y": "g1", "z": None}
    assert resolve_api_keys(["k:with:colons:grp"], None) == {"k:with:colons:grp": None}  # the whole key
    for bad in (["a", "a"], [" "], ["k group="], ["k g"]):
        with pytest.raises(ValueError, match="api_key"):
            resolve_api_keys(bad, None)


def test_serve_builds_one_server_config_from_its_flags(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "env-key group=ops")
    args = parse("serve", "/models/m", "--trust-client-cache-salt", "--metrics-public", "--max-body-bytes", "1MiB",
                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-prompts-per-request", "4",
                 "--allowed-media-domains", "example.com", "--lora-modules", "a=/adapters/a")
    config = server_config_from(args)
    assert config == ServerConfig(api_keys={"env-key": "ops"}, served_model_name="/models/m",
                                  trust_client_cache_salt=True, metrics_public=True, max_body_bytes=1 << 20,
                                  log_stats_interval=10.0, chat_options=ChatOptions(True, "hermes"),
                                  limits=RequestLimits(max_prompts_per_request=4), media=config.media,
                                  lora_modules=(("a", "/adapters/a"),))
    assert config.media.allowed_media_domains == ("example.com",)
    assert pickle.loads(pickle.dumps(config)) == config  # what each API server of --api-server-count gets
    assert "env-key" not in repr(config) and "secret" not in repr(replace(config, cache_salt_secret=b"secret"))
    monkeypatch.delenv(API_KEY_ENV)
    defaults = server_config_from(parse("serve"))
    assert (defaults.api_keys, defaults.served_model_name, defaults.max_body_bytes) == (
        None, "stagedserve-default", DEFAULT_MAX_BODY_BYTES)


def test_serve_refuses_a_bad_server_option_before_loading_the_model(capsys):
    assert main(["serve", "/no/such/model", "--enable-auto-tool-choice"]) == 2
    assert "tool_call_parser: --enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    assert main(["serve", "/no/such/model", "--api-key", "k group=no spaces"]) == 2
    assert "api_key: entry #1 must be KEY or 'KEY group=NAME'" in capsys.readouterr().err
    assert main(["serve", "/no/such/model", "--api-key", "k group=bad!"]) == 2
    assert "api_keys: group of key #1 must match" in capsys.readouterr().err


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = AsyncLLM.from_llm(make_llm(tiny_llama), log_stats_interval=None)
    yield engine
    engine.shutdown()


SERVER_FIELDS = dict(api_keys={"k1": "ops", "k2": None}, served_model_name="m", trust_client_cache_salt=True,
                     metrics_public=True, max_body_bytes=1024, cache_salt_secret=b"s" * 32,
                     chat_options=ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes"),
                     limits=RequestLimits(max_prompts_per_request=3),
                     media=MediaOptions(allowed_media_domains=("example.com",)))


def test_create_app_with_a_server_config_is_create_app_with_its_fields_as_keywords(engine):
    by_config = create_app(engine, ServerConfig(**SERVER_FIELDS))
    by_keywords = create_app(engine, **SERVER_FIELDS)
    replaced = create_app(engine, ServerConfig(**SERVER_FIELDS), metrics_public=False, max_body_bytes=2048)
    assert by_config.state.server_config == by_keywords.state.server_config == ServerConfig(**SERVER_FIELDS)
    assert replaced.state.server_config == ServerConfig(**{**SERVER_FIELDS, "metrics_public": False,
                                                           "max_body_bytes": 2048})
    salts = set()
    for app in (by_config, by_keywords):
        serving = app.state.serving
        assert app.state.api_keys.groups == ["key#2", "ops"]
        assert app.state.public_paths == {"/health", "/metrics"}
        assert (serving.served_model_name, serving.trust_client_cache_salt) == ("m", True)
        assert (serving.chat_options, serving.limits) == (SERVER_FIELDS["chat_options"], SERVER_FIELDS["limits"])
        assert serving.media.options == SERVER_FIELDS["media"]
        salts.add(serving.salter.salt("ops"))
        with TestClient(app) as client:
            assert client.get("/v1/models").status_code == 401
            assert client.get("/v1/models", headers=auth("k1")).json()["data"][0]["id"] == "m"
            assert client.post("/v1/completions", headers=auth("k1"), content=b"x" * 1500).status_code == 413
    assert len(salts) == 1  # the same secret: the same salt for a group
    assert replaced.state.public_paths == {"/health"}


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_body_bytes": 0}, "max_body_bytes: must be a positive integer, got 0"),
    ({"max_body_bytes": "4MiB"}, "max_body_bytes: must be a positive integer, got '4MiB'"),
    ({"api_keys": []}, "api_keys: empty; pass None to run without authentication"),
    ({"api_keys": ["a", "a"]}, "api_keys: the same key is listed twice"),
    ({"api_keys": {"a b": None}}, "api_keys: key #1 must be a non-empty string without whitespace"),
    ({"api_keys": {"k": "no spaces"}}, "api_keys: group of key #1 must match"),
])
def test_a_bad_server_option_raises_the_value_error_create_app_raised(engine, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ServerConfig(**fields)
    with pytest.raises(ValueError, match=re.escape(message)):
        create_app(engine, **fields)
    with pytest.raises(ValueError, match=re.escape(message)):
        create_app(engine, ServerConfig(), **fields)


@pytest.fixture
def fake_uvicorn_run(monkeypatch):
    """``serve`` would block in ``uvicorn.run``: record its arguments instead."""
    import uvicorn

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append((app, kwargs)))
    return calls


def test_serve_reports_an_engine_argument_error_without_starting(tiny_llama, capsys, fake_uvicorn_run):
    assert main(["serve", str(tiny_llama), "--max-model-len", "256", "--attention-backend", "bogus"]) == 2
    assert "attention_backend" in capsys.readouterr().err
    assert fake_uvicorn_run == []


def test_serve_builds_the_app_logs_its_configuration_and_runs_uvicorn(tiny_llama, fake_uvicorn_run, caplog,
                                                                        monkeypatch):
    monkeypatch.setenv("STAGEDSERVE_API_KEY", "ignored-because-flags-win")
    with caplog.at_level("INFO", logger="stagedserve"):
        code = main(["serve", str(tiny_llama), "--port", "0", "--max-model-len", "128", "--num-kv-blocks", "16",
                     "--api-key", "k1 group=ops", "--api-key", "k2", "--metrics-public", "--log-stats-interval", "0",
                     "--no-engine-process"])
    assert code == 0
    [(app, kwargs)] = fake_uvicorn_run
    assert (kwargs["host"], kwargs["port"]) == ("127.0.0.1", 0)
    assert app.state.api_keys.groups == ["key#2", "ops"]
    assert app.state.public_paths == {"/health", "/metrics"}
    assert app.state.serving.served_model_name == str(tiny_llama)
    assert app.state.engine.max_model_len == 128
    log = caplog.text
    assert "engine arguments from the command line: {'max_model_len': 128, 'num_kv_blocks': 16}" in log
    assert "server batch defaults: max_num_seqs=128 max_num_batched_tokens=2048" in log
    assert "max_num_seqs=128" in log.split("resolved engine configuration", 1)[1]
    assert "route: POST       /v1/completions  (API key)" in log and "/metrics  (public)" in log
    assert "k1" not in log and "ignored-because" not in log
    app.state.engine.shutdown()


def test_make_tiny_model_writes_a_loadable_checkpoint(tmp_path, capsys):
    target = tmp_path / "tiny-qwen3"
    assert main(["make-tiny-model", str(target), "--arch", "qwen3", "--seed", "3"]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert any(target.glob("*.safetensors")) and (target / "tokenizer.json").is_file()


def test_bench_subcommands_are_added_when_their_module_exists(monkeypatch):
    calls = []

    def add_bench_subcommands(subparsers):
        bench = subparsers.add_parser("bench")
        bench.add_argument("--rate", type=float)
        bench.set_defaults(func=lambda args: calls.append(args.rate) or 0)

    package = types.ModuleType("stage5_server.bench")
    package.__path__ = []
    module = types.ModuleType("stage5_server.bench.cli")
    module.add_bench_subcommands = add_bench_subcommands
    monkeypatch.setitem(sys.modules, "stage5_server.bench", package)
    monkeypatch.setitem(sys.modules, "stage5_server.bench.cli", module)
    assert main(["bench", "--rate", "2.5"]) == 0
    assert calls == [2.5]


@pytest.mark.slow
def test_stagedserve_serve_runs_a_secured_server_and_stops_cleanly_on_sigint(tiny_llama, tmp_path):
    log = (tmp_path / "serve.log").open("w+")
    process, url = spawn_serve(tiny_llama, log, "--max-model-len", "128", "--num-kv-blocks", "16",
                               "--served-model-name", "tiny", "--uvicorn-log-level", "warning",
                               env={"STAGEDSERVE_API_KEY": "env-key group=ops"})
    healthy = serving_or_exited(process, url)

    try:
        assert wait_until(healthy, timeout=90, interval=0.2) and process.poll() is None
        assert httpx.get(f"{url}/v1/models").status_code == 401
        response = httpx.post(f"{url}/v1/chat/completions", headers=auth("env-key"), timeout=30,
                              json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 3})
        assert response.status_code == 200
    finally:
        code = stop_serve(process, timeout=30)
    log.seek(0)
    output = log.read()
    assert code == 0, output
    assert "route: POST       /v1/chat/completions  (API key)" in output
    assert "route: GET        /health  (public)" in output
    assert "API keys: 1 from $STAGEDSERVE_API_KEY, trust groups: ops" in output
    assert "env-key" not in output  # keys are never logged
    assert "max_model_len=128" in output
