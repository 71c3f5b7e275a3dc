"""The prefill/decode K/V channel probed from outside, with two trust groups (``two_trust_groups``): a prefill
server and a decode server (``P2pZmqConnector``) behind the disaggregation proxy, over real HTTP and real
ZeroMQ sockets, and strangers on the channel's port.

- A process that takes the consumer's port before the consumer receives no K/V from the producer.
- A stranger that sends K/V to the consumer, without the shared secret or with another one, gets no ``ok``,
  stores nothing and is logged; the groups' answers stay those of one engine.
- A message part over ``max_message_bytes``, even from a peer with the secret, is dropped with its peer.
- The consumer gives a request only the blocks sent for it (its transfer id): blocks of a request sent to the
  prefill server alone, or under another request's id, serve nobody on the decode server.
"""

from __future__ import annotations

import logging
import secrets
import socket

import pytest
import requests
import zmq

from stage5_server.kv_transfer.proxy import create_proxy_app
from stage5_server.server import create_app
from tests.stage5.server_fixtures import make_llm, metric, running_server

KV_SECRET = secrets.token_hex(32)
SALT_SECRET = secrets.token_bytes(32)  # both servers salt a group's requests alike
ENGINE = dict(device="cpu", dtype="float32", enable_prefix_caching=True, block_size=16)
MAX_MESSAGE_BYTES = 1 << 20
PROMPT = "Prefill computes the prompt's blocks once; decode takes them over the channel and goes on. " * 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def p2p(role: str, port: int) -> dict:
    return {"kv_connector": "P2pZmqConnector", "kv_role": role,
            "kv_connector_extra_config": {"kv_port": port, "max_message_bytes": MAX_MESSAGE_BYTES}}


@pytest.fixture(scope="module")
def pair(tiny_llama, two_trust_groups):
    """A decode server, a prefill server and the proxy in front of them; their URLs and the channel's port."""
    port = free_port()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("STAGEDSERVE_KV_TRANSFER_SECRET", KV_SECRET)
        decode = create_app(make_llm(tiny_llama, kv_transfer_config=p2p("kv_consumer", port), **ENGINE),
                            api_keys=two_trust_groups.api_keys, cache_salt_secret=SALT_SECRET)
        prefill = create_app(make_llm(tiny_llama, kv_transfer_config=p2p("kv_producer", port), **ENGINE),
                             api_keys=two_trust_groups.api_keys, cache_salt_secret=SALT_SECRET)
        with running_server(decode) as consumer, running_server(prefill) as producer, \
                running_server(create_proxy_app(producer.url, consumer.url)) as proxy:
            yield {"decode": consumer.url, "prefill": producer.url, "proxy": proxy.url, "port": port}


@pytest.fixture(scope="module")
def one_engine(tiny_llama):
    """What one engine answers, for comparison."""
    llm = make_llm(tiny_llama, **ENGINE)
    yield lambda prompt: llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0].text
    llm.shutdown()


def greedy():
    from shared.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def complete(url: str, key: str, prompt: str = PROMPT, transfer_id: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}", **({"X-KV-Transfer-Id": transfer_id} if transfer_id else {})}
    response = requests.post(f"{url}/v1/completions", headers=headers, timeout=120,
                             json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def counter(url: str, key: str, name: str, **labels: str) -> float:
    text = requests.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    return metric(text, name, **labels) or 0.0


def p2p_hits(pair: dict, key: str) -> float:
    return counter(pair["decode"], key, "vllm:prompt_tokens_cached_by_source_total", source="p2p")


def well_formed_message(num_blocks: int = 1) -> list[bytes]:
    """K/V for the tiny Llama's blocks (2 layers, 16 tokens, 2 KV heads of 32), under a transfer id a client
    of the proxy could guess at."""
    import json

    shape = [num_blocks, 2, 16, 2, 32]
    header = {"dtype": "torch.float32", "shape": shape, "hashes": ["ab" * 32] * num_blocks,
              "transfer_ids": ["guessed-transfer-id-0000"] * num_blocks}
    size = num_blocks * 2 * 16 * 2 * 32 * 4
    return [json.dumps(header).encode(), b"\x01" * size, b"\x01" * size]


def test_groups_behind_the_proxy_get_one_engines_answers_from_transferred_blocks(pair, one_engine, two_trust_groups):
    for key in (two_trust_groups.a_key, two_trust_groups.b_key):
        before = p2p_hits(pair, key)
        assert complete(pair["proxy"], key)["choices"][0]["text"] == one_engine(PROMPT)
        assert p2p_hits(pair, key) > before  # the blocks came over the channel


def test_a_stranger_gets_no_ok_from_the_consumer_stores_nothing_and_is_logged(pair, one_engine, two_trust_groups,
                                                                              caplog):
    from stage5_server.kv_transfer.peer_auth import secure_producer_socket

    key = two_trust_groups.b_key
    received = counter(pair["decode"], key, "stagedserve:kv_p2p_received_blocks_total")
    context = zmq.Context()
    with caplog.at_level(logging.WARNING, logger="stagedserve"):
        for keys in (None, secrets.token_hex(32)):  # no CURVE at all; CURVE with another secret
            stranger = context.socket(zmq.REQ)
            stranger.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                secure_producer_socket(stranger, keys.encode()).close()
            stranger.connect(f"tcp://127.0.0.1:{pair['port']}")
            stranger.send_multipart(well_formed_message())
            assert not stranger.poll(3000), "the consumer answered a stranger"
            stranger.close()
    context.term()
    assert counter(pair["decode"], key, "stagedserve:kv_p2p_received_blocks_total") == received
    assert caplog.text.count("kv_transfer: refused a peer") >= 2, caplog.text
    assert complete(pair["proxy"], key, PROMPT + " (after)")["choices"][0]["text"] == one_engine(PROMPT + " (after)")


def test_a_message_over_the_size_cap_is_dropped_even_from_a_peer_with_the_secret(pair, two_trust_groups):
    from stage5_server.kv_transfer.peer_auth import secure_producer_socket

    key = two_trust_groups.a_key
    received = counter(pair["decode"], key, "stagedserve:kv_p2p_received_blocks_total")
    context = zmq.Context()
    peer = context.socket(zmq.REQ)
    peer.setsockopt(zmq.LINGER, 0)
    secure_producer_socket(peer, KV_SECRET.encode()).close()
    peer.connect(f"tcp://127.0.0.1:{pair['port']}")
    blocks = MAX_MESSAGE_BYTES // (2 * 16 * 2 * 32 * 4) + 1  # one block more than a part may hold
    peer.send_multipart(well_formed_message(blocks))
    assert not peer.poll(3000), "the consumer took a message over its cap"
    peer.close()
    context.term()
    assert counter(pair["decode"], key, "stagedserve:kv_p2p_received_blocks_total") == received
    complete(pair["proxy"], key, PROMPT + " (still serving)")


def test_blocks_serve_only_the_request_they_were_sent_for(pair, two_trust_groups):
    key = two_trust_groups.a_key
    alone = "(the prefill server alone) " + PROMPT  # a prefix no earlier request had
    complete(pair["prefill"], key, alone)  # no proxy, no transfer id: nobody on the decode side waits for it
    before = p2p_hits(pair, key)
    assert complete(pair["decode"], key, alone)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert p2p_hits(pair, key) == before

    other = "(another request's id) " + PROMPT
    complete(pair["prefill"], key, other, transfer_id="first-request-transfer-id")
    assert complete(pair["decode"], key, other, transfer_id="second-request-transfer-id")[
        "usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert p2p_hits(pair, key) == before

    same = "(its own id) " + PROMPT
    complete(pair["prefill"], key, same, transfer_id="its-own-transfer-id-0001")
    assert complete(pair["decode"], key, same, transfer_id="its-own-transfer-id-0001")[
        "usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert p2p_hits(pair, key) > before


def test_a_process_that_took_the_consumers_port_first_receives_no_kv(tiny_llama, two_trust_groups, caplog):
    port = free_port()
    context = zmq.Context()
    squatter = context.socket(zmq.REP)
    squatter.setsockopt(zmq.LINGER, 0)
    squatter.bind(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("STAGEDSERVE_KV_TRANSFER_SECRET", KV_SECRET)
            app = create_app(make_llm(tiny_llama, kv_transfer_config=p2p("kv_producer", port), **ENGINE),
                             api_keys=two_trust_groups.api_keys, cache_salt_secret=SALT_SECRET)
        with caplog.at_level(logging.WARNING, logger="stagedserve"), running_server(app) as producer:
            complete(producer.url, two_trust_groups.a_key, transfer_id="a-request-in-transfer-01")
            assert not squatter.poll(1000), "the producer sent K/V to a process without the secret"
        assert "is not the consumer" in caplog.text, caplog.text
    finally:
        squatter.close()
        context.term()
