"""The KV connector (``kv_transfer/``): an offload tier that keeps prefix hits past a full pool, and
prefill/decode disaggregation, each held to the same greedy tokens as one engine without them."""

from __future__ import annotations

import json
import random
import socket
import time

import pytest

from shared.sampling_params import SamplingParams
from stage5_server import LLM
from stage5_server.cli import make_parser
from stage5_server.config import EngineConfig
from stage5_server.config.kv_transfer import KVTransferConfig
from stage5_server.kv_transfer import FilledBlock, KVConnectorRole, make_kv_connector
from stage5_server.kv_transfer import p2p as p2p_module
from tests.stage5.lora_adapters import make_adapter

# A pool of 32 blocks of 4 tokens holds three of the six 40-token conversations below: by the second
# turn every prefix has been evicted from it.
POOL = dict(block_size=4, num_kv_blocks=32, max_num_seqs=2, max_model_len=64, device="cpu", dtype="float32")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def conversations(count: int = 6, length: int = 40, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(5, 250) for _ in range(length)]} for _ in range(count)]


def two_turns(llm: LLM, prompts: list[dict], second: slice = slice(None)) -> list[list[int]]:
    """Each prompt alone, all of them twice (the second time in the order ``second`` picks): the second round
    finds its prefixes only where they were kept."""
    return [llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            for turn in (prompts, prompts[second]) for prompt in turn]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def p2p(role: str, port: int) -> dict:
    return {"kv_connector": "P2pZmqConnector", "kv_role": role, "kv_connector_extra_config": {"kv_port": port}}


KV_SECRET = "kv-transfer-secret-" + "0123456789abcdef" * 2  # what both instances of a pair share


@pytest.fixture(autouse=True)
def kv_transfer_secret(monkeypatch):
    monkeypatch.setenv("STAGEDSERVE_KV_TRANSFER_SECRET", KV_SECRET)


def in_transfer(prompts: list[dict], tag: str = "t") -> list[dict]:
    """Each prompt with a transfer id of its own, as the proxy gives a request on both instances."""
    return [{**prompt, "kv_transfer_params": {"transfer_id": f"{tag}-transfer-{i:08d}"}}
            for i, prompt in enumerate(prompts)]


# ---- the offload tier ----------------------------------------------------------------------------------

def test_offloaded_blocks_come_back_after_eviction_with_the_same_greedy_tokens(tiny_llama):
    prompts = conversations()
    plain = LLM(str(tiny_llama), **POOL)
    want = two_turns(plain, prompts)
    assert plain.engine.stats().prefix_cache_hits == 0  # the pool alone kept nothing for the second turn
    offload = LLM(str(tiny_llama), kv_offloading_size=0.001, **POOL)
    assert two_turns(offload, prompts) == want
    stats = offload.engine.stats()
    tier = stats.kv_connector
    assert tier.host_hit_tokens == 6 * 36  # every conversation's 9 full prompt blocks (the 10th holds its last token)
    assert tier.offload_loaded_blocks * 4 == tier.host_hit_tokens
    assert stats.prefix_cache_hits == tier.host_hit_tokens  # every hit came back from the tier


def test_a_full_tier_drops_its_least_recently_used_blocks_and_tokens_stay_the_same(tiny_llama):
    prompts, newest_first = conversations(), slice(None, None, -1)
    want = two_turns(LLM(str(tiny_llama), **POOL), prompts, newest_first)
    offload = LLM(str(tiny_llama), kv_offloading_size=0.0001, **POOL)  # 26 slots for 66 blocks
    assert two_turns(offload, prompts, newest_first) == want
    tier = offload.engine.stats().kv_connector
    assert tier.offload_capacity_blocks < tier.offload_saved_blocks and tier.offload_evicted_blocks > 0
    assert tier.offload_used_blocks == tier.offload_capacity_blocks
    assert tier.host_hit_tokens > 0  # the newest conversations were still there


def test_a_block_offloaded_for_one_trust_group_or_adapter_is_never_read_for_another(tiny_llama, tmp_path):
    adapter = make_adapter(tiny_llama, tmp_path / "adapter", seed=1)
    from stage5_server.lora import LoRARequest

    llm = LLM(str(tiny_llama), kv_offloading_size=0.001, enable_lora=True, **POOL)
    prompt, flush = conversations(1, seed=1)[0], conversations(4, seed=2)

    def host_hits(**kwargs) -> int:
        before = llm.engine.stats().kv_connector.host_hit_tokens
        llm.add_request(prompt, GREEDY, **kwargs)
        while llm.engine.has_unfinished_requests():
            llm.step()
        hits = llm.engine.stats().kv_connector.host_hit_tokens - before
        for other in flush:  # push the prompt's blocks out of the pool (the tier keeps them)
            llm.generate([other], GREEDY, use_tqdm=False)
        return hits

    assert host_hits(cache_salt="tenant-a") == 0
    assert host_hits(cache_salt="tenant-b") == 0  # the same tokens, another trust group
    assert host_hits() == 0  # nor a request with no salt
    assert host_hits(cache_salt="tenant-a") == 36  # its own group finds all 9 blocks
    lora = LoRARequest("every", 1, str(adapter))
    assert host_hits(lora_request=lora) == 0  # base-model blocks are not the adapter's
    assert host_hits(lora_request=lora) == 36


def test_a_failed_step_forgets_what_it_was_to_save_and_a_reset_forgets_everything():
    config = KVTransferConfig.create(None, kv_offloading_size=0.001)
    tier = make_kv_connector(config, KVConnectorRole.SCHEDULER, 4, 1024)
    hashes = [bytes([i]) * 32 for i in range(4)]

    class Request:
        request_id = "r"

    metadata = tier.build_connector_meta([FilledBlock(h, i) for i, h in enumerate(hashes[:2])])
    assert metadata.saves == [(0, 0), (1, 1)]
    assert tier.get_num_new_matched_tokens(Request, 0, hashes) == 8
    tier.step_failed(metadata)
    assert tier.get_num_new_matched_tokens(Request, 0, hashes) == 0
    assert tier.stats().offload_used_blocks == 0
    tier.build_connector_meta([FilledBlock(h, i) for i, h in enumerate(hashes)])
    assert tier.get_num_new_matched_tokens(Request, 4, hashes) == 12  # past a local hit of one block
    tier.reset_cache()
    assert tier.get_num_new_matched_tokens(Request, 0, hashes) == 0


def test_the_tier_lookup_counts_the_run_of_stored_blocks_after_the_local_hit():
    tier = make_kv_connector(KVTransferConfig.create(None, kv_offloading_size=0.001), KVConnectorRole.SCHEDULER,
                             4, 1024)
    hashes = [bytes([i]) * 32 for i in range(5)]
    tier.build_connector_meta([FilledBlock(hashes[i], i) for i in (1, 2, 4)])  # stored: 1, 2 and 4
    order = list(tier.slot_of)

    class Request:
        request_id = "r"

    assert tier.get_num_new_matched_tokens(Request, 0, hashes) == 0  # block 0 is missing: nothing after it helps
    assert tier.matched["r"] == []
    assert tier.get_num_new_matched_tokens(Request, 4, hashes) == 8  # blocks 1 and 2; block 3 is missing
    assert tier.matched["r"] == hashes[1:3]
    assert tier.get_num_new_matched_tokens(Request, 16, hashes) == 4  # past a hit of four blocks: block 4
    assert list(tier.slot_of) == order  # a lookup alone moves nothing in the LRU order


def test_a_weight_update_empties_the_tier_too(tiny_llama):
    llm = LLM(str(tiny_llama), kv_offloading_size=0.001, **POOL)
    prompts = conversations(4)
    for prompt in prompts:
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.engine.stats().kv_connector.offload_used_blocks > 0
    assert llm.engine.reset_prefix_cache()
    assert llm.engine.stats().kv_connector.offload_used_blocks == 0
    llm.generate([prompts[0]], GREEDY, use_tqdm=False)
    assert llm.engine.stats().kv_connector.host_hit_tokens == 0


@pytest.mark.slow
def test_two_tensor_parallel_ranks_each_keep_their_heads_in_the_tier(tiny_llama):
    prompts = conversations(4)
    want = two_turns(LLM(str(tiny_llama), **POOL), prompts)
    llm = LLM(str(tiny_llama), kv_offloading_size=0.001, tensor_parallel_size=2, **POOL)
    try:
        assert two_turns(llm, prompts) == want
        assert llm.engine.stats().kv_connector.host_hit_tokens > 0
    finally:
        llm.engine.shutdown()


# ---- configuration ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value, message", [
    ("{not json", "not JSON"),
    ('["OffloadingConnector"]', "must be a JSON object"),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "kv_connector: must be one of"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "kv_producer"}, "kv_role"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}, "cpu_bytes_to_use"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"cpu_bytes_to_use": -1}}, "positive integer"),
    ({"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer"}, "kv_port"),
    ({"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
      "kv_connector_extra_config": {"kv_port": 70000}}, "kv_port"),
    ({"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer",
      "kv_connector_extra_config": {"kv_port": 9000, "buffer_bytes": 10}}, "consumer's setting"),
    ({"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer",
      "kv_connector_extra_config": {"kv_port": 9000, "kv_host": "a b"}}, "kv_host"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "extra": 1}, "unknown key 'extra'"),
])
def test_a_bad_kv_transfer_config_is_refused_naming_the_key(tiny_llama, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(str(tiny_llama), kv_transfer_config=value, device="cpu")


def test_a_connector_needs_prefix_caching_one_flag_and_room_for_a_block(tiny_llama):
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig.create(str(tiny_llama), kv_offloading_size=1, enable_prefix_caching=False, device="cpu")
    with pytest.raises(ValueError, match="not both"):
        EngineConfig.create(str(tiny_llama), kv_offloading_size=1, kv_transfer_config=p2p("kv_producer", 9000))
    with pytest.raises(ValueError, match="one-rank engines"):
        EngineConfig.create(str(tiny_llama), kv_transfer_config=p2p("kv_producer", 9000), tensor_parallel_size=2,
                            device="cpu")
    with pytest.raises(ValueError, match="hold no block"):
        LLM(str(tiny_llama), kv_offloading_size=1e-9, **POOL)


@pytest.mark.parametrize("flags", [("--kv-transfer-config", "{bad"), ("--kv-offloading-size", "-1"),
                                   ("--kv-transfer-config", '{"kv_connector": "OffloadingConnector"}')])
def test_serve_refuses_a_bad_connector_flag_before_anything_starts(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        make_parser().parse_args(["serve", "model", *flags])
    assert exit_info.value.code == 2
    assert "kv" in capsys.readouterr().err


# ---- prefill/decode disaggregation ----------------------------------------------------------------------

def test_a_decode_instance_fed_by_a_prefill_instance_gives_one_engines_tokens_computing_one_block_or_less(
        tiny_llama):
    prompts, port = conversations(4, length=37), free_port()
    engine = dict(POOL, num_kv_blocks=64, max_num_seqs=4, max_model_len=128)
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), **engine).generate(prompts, GREEDY, use_tqdm=False)]
    consumer = LLM(str(tiny_llama), kv_transfer_config=p2p("kv_consumer", port), **engine)
    producer = LLM(str(tiny_llama), kv_transfer_config=p2p("kv_producer", port), **engine)
    try:
        producer.generate(in_transfer(prompts), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        got = consumer.generate(in_transfer(prompts), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        stats = consumer.engine.stats()
        assert stats.kv_connector.p2p_hit_tokens == 4 * 36 and stats.kv_connector.p2p_received_blocks == 4 * 9
        assert stats.num_prompt_tokens_computed == 4  # each prompt's last token; its 9 full blocks came over
        assert all(o.num_cached_tokens == 36 for o in got)
    finally:
        consumer.engine.shutdown()
        producer.engine.shutdown()


def test_a_producer_whose_consumer_is_gone_still_answers_and_a_consumer_without_blocks_prefills(
        tiny_llama, monkeypatch):
    monkeypatch.setattr(p2p_module, "SEND_TIMEOUT_S", 0.5)
    prompts, port = conversations(2), free_port()
    producer = LLM(str(tiny_llama), kv_transfer_config=p2p("kv_producer", port), **POOL)
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_llama), **POOL).generate(prompts, GREEDY, use_tqdm=False)]
    try:
        start = time.monotonic()
        answers = producer.generate(in_transfer(prompts), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in answers] == want
        assert time.monotonic() - start < 5  # one step waited out the timeout; the rest sent nothing
        worker = producer.engine.model_executor.driver_worker
        assert worker.kv_connector.send_failures == 1
    finally:
        producer.engine.shutdown()
    consumer = LLM(str(tiny_llama), kv_transfer_config=p2p("kv_consumer", port), **POOL)
    try:
        answers = consumer.generate(in_transfer(prompts), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in answers] == want
        assert consumer.engine.stats().kv_connector.p2p_hit_tokens == 0
    finally:
        consumer.engine.shutdown()


def test_the_consumer_refuses_a_malformed_message_and_keeps_nothing(tiny_llama):
    import zmq

    from stage5_server.kv_transfer.peer_auth import secure_producer_socket

    port = free_port()
    consumer = LLM(str(tiny_llama), kv_transfer_config=p2p("kv_consumer", port), **POOL)
    socket_ = zmq.Context.instance().socket(zmq.REQ)
    socket_.setsockopt(zmq.LINGER, 0)
    secure_producer_socket(socket_, KV_SECRET.encode()).close()  # the producer's keys: past the handshake
    socket_.connect(f"tcp://127.0.0.1:{port}")
    try:
        for frames in ([b"not json", b"", b""], [b'{"dtype": "torch.float32", "shape": [1, 2, 4, 2, 16], '
                                                  b'"hashes": ["00"], "transfer_ids": ["t"]}', b"\x00" * 8,
                                                  b"\x00" * 8],
                       [b'{"dtype": "torch.float32", "shape": [1, 2, 4, 2, 16], "hashes": ["00"], '
                        b'"transfer_ids": [null]}', b"\x00" * 8, b"\x00" * 8]):
            socket_.send_multipart(frames)
            assert socket_.poll(5000)
            assert socket_.recv().startswith(b"error")
        assert consumer.engine.stats().kv_connector.p2p_received_blocks == 0
    finally:
        socket_.close()
        consumer.engine.shutdown()


@pytest.mark.slow
def test_behind_the_proxy_a_prefill_and_a_decode_server_answer_as_one_server(tiny_llama, tmp_path):
    """Two ``stagedserve serve`` processes and the proxy: the same greedy text streamed and not, as the prefill
    server alone gives; a client that leaves mid-stream leaves nothing running; a killed decode server is a
    clean 502 and an unhealthy ``/health``."""
    import httpx
    import openai

    from stage5_server.kv_transfer.proxy import create_proxy_app
    from tests.stage5.server_fixtures import (
        metric,
        running_server,
        serving_or_exited,
        spawn_serve,
        stop_serve,
        wait_until,
    )

    port, flags = free_port(), ("--max-model-len", "256", "--num-kv-blocks", "128", "--block-size", "4",
                                "--dtype", "float32", "--log-stats-interval", "0")
    secret = {"STAGEDSERVE_CACHE_SALT_SECRET": "0123456789abcdef" * 4,  # both salt every request alike
              "STAGEDSERVE_KV_TRANSFER_SECRET": KV_SECRET}
    consumer, consumer_url = spawn_serve(tiny_llama, (tmp_path / "decode.log").open("w"), *flags,
                                         "--kv-transfer-config", json.dumps(p2p("kv_consumer", port)), env=secret)
    producer, producer_url = spawn_serve(tiny_llama, (tmp_path / "prefill.log").open("w"), *flags,
                                         "--kv-transfer-config", json.dumps(p2p("kv_producer", port)), env=secret)
    try:
        for process, url in ((consumer, consumer_url), (producer, producer_url)):
            assert wait_until(serving_or_exited(process, url), timeout=120) and process.poll() is None
        with running_server(create_proxy_app(producer_url, consumer_url)) as proxy:
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
            direct = openai.OpenAI(base_url=producer_url + "/v1", api_key="none", max_retries=0)
            model = client.models.list().data[0].id
            prompt = "blocks of a few tokens, found through a table, waste at most one partial block " * 3
            ask = dict(model=model, prompt=prompt, max_tokens=16, temperature=0)
            want = direct.completions.create(**ask).choices[0].text
            assert client.completions.create(**ask).choices[0].text == want
            streamed = "".join(c.choices[0].text for c in client.completions.create(**ask, stream=True) if c.choices)
            assert streamed == want
            chat = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0)
            assert client.chat.completions.create(**chat).choices[0].message.content == \
                direct.chat.completions.create(**chat).choices[0].message.content
            metrics = httpx.get(consumer_url + "/metrics").text
            assert metric(metrics, "vllm:prompt_tokens_cached_by_source_total", source="p2p") > 0
            assert metric(metrics, "stagedserve:kv_p2p_received_blocks_total") > 0

            stream = client.completions.create(**{**ask, "max_tokens": 150, "prompt": prompt + "again"}, stream=True)
            next(iter(stream))
            stream.close()  # the client leaves mid-stream

            def idle(url: str) -> bool:
                text = httpx.get(url + "/metrics").text
                return metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:kv_cache_usage_perc") == 0

            assert wait_until(lambda: idle(consumer_url) and idle(producer_url), timeout=30)
            # a client that leaves early, while the prefill server or the decode server works: 150 tokens are
            # never made in 50 ms, so the timeout always comes first
            with pytest.raises(httpx.TimeoutException):
                httpx.post(proxy.url + "/v1/completions",
                           json={**ask, "prompt": prompt + "early", "max_tokens": 150, "ignore_eos": True},
                           timeout=0.05)
            assert wait_until(lambda: idle(consumer_url) and idle(producer_url), timeout=30)

            stream = client.completions.create(**{**ask, "max_tokens": 150, "prompt": prompt + "once more"},
                                               stream=True)
            next(iter(stream))
            consumer.kill()  # the decode server dies mid-stream: the stream ends with an error
            with pytest.raises(openai.APIError):
                for _ in stream:
                    pass
            consumer.wait(timeout=30)
            with pytest.raises(openai.APIStatusError) as error:
                client.completions.create(**ask)
            assert error.value.status_code == 502 and "decode instance" in error.value.message
            assert httpx.get(proxy.url + "/health").status_code == 503
            assert httpx.get(producer_url + "/health").status_code == 200
    finally:
        for process in (producer, consumer):
            if process.poll() is None:
                stop_serve(process)


def test_the_consumer_listens_on_loopback_and_a_short_salt_secret_is_refused(tiny_llama):
    import psutil

    from stage5_server.cli.options import cache_salt_secret

    port = free_port()
    consumer = LLM(str(tiny_llama), kv_transfer_config=p2p("kv_consumer", port), **POOL)
    try:
        listening = [c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        assert ("127.0.0.1", port) in [(a.ip, a.port) for a in listening]
    finally:
        consumer.engine.shutdown()
    with pytest.raises(ValueError, match="at least 32 characters"):
        cache_salt_secret("too-short")
    assert cache_salt_secret(None) is None
