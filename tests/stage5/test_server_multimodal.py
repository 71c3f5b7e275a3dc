"""Images through the server on the tiny random LLaVA: ``image_url`` parts (data and http URLs) in
chat, streaming and not, the Responses API's ``input_image``, ``/tokenize`` showing the placeholders,
the openai client sending a data URL; and every media rule refusing a request with a 400 against
HTTP servers this test starts on 127.0.0.1 (an allowed host, a redirect, a huge download, a
decompression bomb, a slow server, a name that resolves to a private address), the server healthy
afterwards and each URL fetched once per request."""

from __future__ import annotations

import http.server
import io
import json
import struct
import time
import zlib

import pytest
import requests

from stage5_server.server import create_app
from stage5_server.server.media import MediaOptions
from tests.stage5.server_fixtures import (
    LoopbackHTTPServer,
    auth,
    make_llm,
    media_rules,
    running_server,
    tiny_llava_app,
)
from tests.stage5.test_multimodal import data_url, hf, picture, reference  # noqa: F401  (hf: a fixture)

KEY = "test-key-images"
IMAGE_TOKENS = 25
PNG = io.BytesIO()
picture(21).save(PNG, format="PNG")
PNG = PNG.getvalue()


def bomb_png(side: int = 12000) -> bytes:
    """A valid grayscale PNG of side x side zero pixels: about 150 KB that decode to 144 MB."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    compressor, row, parts = zlib.compressobj(9), b"\0" * (side + 1), []
    for _ in range(side):
        parts.append(compressor.compress(row))
    parts.append(compressor.flush())
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", b"".join(parts)) + chunk(b"IEND", b"")


class MediaHost(LoopbackHTTPServer):
    """An HTTP server on 127.0.0.1 with the files the tests ask for, counting each path's requests."""

    def __init__(self, redirect_to: str | None = None):
        hits: dict[str, int] = {}
        bomb = bomb_png()

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.path = self.path.split("?")[0]  # a query only makes a URL distinct
                hits[self.path] = hits.get(self.path, 0) + 1
                if self.path == "/cat.png":
                    self._send(PNG)
                elif self.path == "/bomb.png":
                    self._send(bomb)
                elif self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", f"{redirect_to}/cat.png")
                    self.end_headers()
                elif self.path == "/huge.png":  # no length announced: 4 MiB until the connection closes
                    self.send_response(200)
                    self.end_headers()
                    try:
                        for _ in range(64):
                            self.wfile.write(b"\0" * 65536)
                    except OSError:
                        pass
                elif self.path == "/slow.png":
                    self.send_response(200)
                    self.end_headers()
                    time.sleep(3)
                else:
                    self.send_response(404)
                    self.end_headers()

            def _send(self, body: bytes):
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.hits = hits
        super().__init__(Handler)


@pytest.fixture(scope="module")
def hosts():
    other = MediaHost()
    host = MediaHost(redirect_to=other.url.replace("127.0.0.1", "localhost"))
    yield host, other
    host.close()
    other.close()


@pytest.fixture(scope="module")
def server(tiny_llava):
    app = tiny_llava_app(tiny_llava, KEY)
    with running_server(app) as running:
        yield running.url, app.state.serving


def media(serving, **options):
    """The server's media rules for a test: the test's own hosts on loopback allowed, unless ``options`` say."""
    return media_rules(serving, **{"allowed_media_domains": ("127.0.0.1",), "allow_private_addresses": True,
                                   **options})


def chat(url: str, *parts, **extra) -> requests.Response:
    content = [{"type": "text", "text": p} if not p.startswith(("data:", "http")) else
               {"type": "image_url", "image_url": {"url": p}} for p in parts]
    body = {"model": "tiny-llava", "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **extra}
    return requests.post(f"{url}/v1/chat/completions", json=body, headers=auth(KEY), timeout=60)


def refused(response: requests.Response, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    assert error["type"] == "invalid_request_error"


def healthy(url: str) -> None:
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    assert chat(url, "Hi", data_url(picture(1))).status_code == 200


# ---- the happy paths -----------------------------------------------------------------------------

def test_a_data_url_image_gives_transformers_greedy_text(server, hf):  # noqa: F811
    url, _ = server
    image = picture(3)
    _, expected = reference(hf, [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                                              {"type": "image_pil", "image_pil": image}]}], 8)
    response = chat(url, "Describe", data_url(image))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == hf[0].tokenizer.decode(expected,
                                                                                        skip_special_tokens=True)
    assert response.json()["usage"]["prompt_tokens"] > IMAGE_TOKENS


def test_the_openai_client_sends_a_data_url_image_unchanged(server):
    openai = pytest.importorskip("openai")
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
    image = data_url(picture(4))
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                             {"type": "image_url", "image_url": {"url": image, "detail": "low"}}]}]
    reply = client.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=8, temperature=0)
    direct = chat(url, "What is it?", image).json()
    assert reply.choices[0].message.content == direct["choices"][0]["message"]["content"]
    stream = client.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=8, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == reply.choices[0].message.content


def test_the_responses_api_takes_input_image(server):
    url, _ = server
    image = data_url(picture(5))
    body = {"model": "tiny-llava", "max_output_tokens": 8, "temperature": 0,
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": "Describe"},
                                   {"type": "input_image", "image_url": image}]}]}
    response = requests.post(f"{url}/v1/responses", json=body, headers=auth(KEY), timeout=60)
    assert response.status_code == 200, response.text
    text = response.json()["output"][0]["content"][0]["text"]
    assert text == chat(url, "Describe", image).json()["choices"][0]["message"]["content"]


def test_tokenize_shows_the_expanded_placeholders(server):
    url, serving = server
    image_token = serving.engine.image_processor.image_token_id
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture(6))}},
                                             {"type": "text", "text": "and"},
                                             {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]
    tokens = requests.post(f"{url}/tokenize", json={"messages": messages}, headers=auth(KEY), timeout=30).json()
    assert tokens["tokens"].count(image_token) == 2 * IMAGE_TOKENS


def test_an_allowed_host_is_fetched_once_per_request(server, hosts):
    url, serving = server
    host, _ = hosts
    with media(serving):
        response = chat(url, "Two of", f"{host.url}/cat.png", "and", f"{host.url}/cat.png")
    assert response.status_code == 200, response.text
    assert host.hits["/cat.png"] == 1
    same = chat(url, "Two of", data_url(picture(21)), "and", data_url(picture(21)))
    assert same.json()["choices"][0]["message"]["content"] == response.json()["choices"][0]["message"]["content"]


# ---- each rule refusing ------------------------------------------------------------------------------

def test_remote_urls_are_refused_by_default(server, hosts):
    url, _ = server
    host, _ = hosts
    before = host.hits.get("/cat.png", 0)
    refused(chat(url, "Look", f"{host.url}/cat.png"), "not in this server's --allowed-media-domains")
    assert host.hits.get("/cat.png", 0) == before  # refused before any connection
    healthy(url)


def test_a_redirect_is_refused_unless_enabled(server, hosts):
    url, serving = server
    host, other = hosts
    with media(serving):
        refused(chat(url, "Look", f"{host.url}/redirect"), "follows no redirects")
    with media(serving, allow_redirects=True):  # the next hop, localhost, is not allowed
        refused(chat(url, "Look", f"{host.url}/redirect"), "'localhost' is not in this server's")
    with media(serving, allow_redirects=True, allowed_media_domains=("127.0.0.1", "localhost")):
        assert chat(url, "Look", f"{host.url}/redirect").status_code == 200
    healthy(url)


def test_a_name_resolving_to_a_private_address_is_refused(server, hosts):
    url, serving = server
    host, _ = hosts
    local = host.url.replace("127.0.0.1", "localhost")
    with media(serving, allowed_media_domains=("localhost", "127.0.0.1"), allow_private_addresses=False):
        refused(chat(url, "Look", f"{local}/cat.png"), "non-public address")
        refused(chat(url, "Look", f"{host.url}/cat.png"), "non-public address")
    healthy(url)


def test_a_download_over_the_size_cap_is_refused_as_it_streams(server, hosts):
    url, serving = server
    host, _ = hosts
    with media(serving, max_download_bytes=1024 * 1024):
        refused(chat(url, "Look", f"{host.url}/huge.png"), "VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB")
    healthy(url)


def test_a_decompression_bomb_is_refused_from_its_header(server, hosts, monkeypatch):
    url, serving = server
    host, _ = hosts
    monkeypatch.setenv("VLLM_MAX_IMAGE_PIXELS", str(1024 * 1024))
    with media(serving):
        refused(chat(url, "Look", f"{host.url}/bomb.png"), "VLLM_MAX_IMAGE_PIXELS")
    healthy(url)


def test_a_slow_server_is_cut_off_by_the_fetch_timeout(server, hosts):
    url, serving = server
    host, _ = hosts
    with media(serving, fetch_timeout_s=0.5):
        started = time.monotonic()
        refused(chat(url, "Look", f"{host.url}/slow.png"), "VLLM_IMAGE_FETCH_TIMEOUT")
        assert time.monotonic() - started < 2.5
    healthy(url)


def test_per_request_processor_kwargs_are_refused_unless_trusted(server):
    url, serving = server
    image = data_url(picture(7))
    refused(chat(url, "Look", image, mm_processor_kwargs={"do_normalize": False}), "--trust-request-mm-kwargs")
    refused(chat(url, "Look", image, media_io_kwargs={"image": {"mode": "L"}}), "--trust-request-mm-kwargs")
    with media(serving, trust_request_mm_kwargs=True):
        plain = chat(url, "Look", image).json()["choices"][0]["message"]["content"]
        raw = chat(url, "Look", image, mm_processor_kwargs={"do_normalize": False})
        assert raw.status_code == 200, raw.text
        assert raw.json()["choices"][0]["message"]["content"] != plain  # the processor saw them
    healthy(url)


def test_more_images_than_the_server_allows_are_refused_before_any_is_loaded(server, hosts):
    url, serving = server
    host, _ = hosts
    with media(serving, max_images_per_request=2):
        before = host.hits.get("/cat.png", 0)
        parts = [f"{host.url}/cat.png?{i}" for i in range(3)]
        refused(chat(url, "Three", *parts), "more than the 2 this server allows")
        assert host.hits.get("/cat.png", 0) == before  # nothing was fetched
        assert chat(url, "Two", *parts[:2]).status_code == 200
        assert host.hits["/cat.png"] == before + 2  # two URLs, each fetched once
    healthy(url)


def test_bad_image_data_is_a_400(server):
    url, _ = server
    refused(chat(url, "Look", "data:image/png;base64,not-base64!"), "not valid base64")
    refused(chat(url, "Look", "data:image/png;base64,aGVsbG8="), "not an image")
    refused(chat(url, "Look", "data:text/plain;base64,aGVsbG8="), "is not an image")
    healthy(url)


def test_media_caps_come_from_vllms_environment_variables(monkeypatch):
    monkeypatch.setenv("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1")
    monkeypatch.setenv("VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB", "2")
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "7")
    options = MediaOptions.from_env(allowed_media_domains=["a.example"])
    assert (options.allow_redirects, options.max_download_bytes, options.fetch_timeout_s) == (True, 2 << 20, 7.0)
    assert MediaOptions().allowed_media_domains == () and not MediaOptions().allow_redirects


def test_a_text_only_model_answers_an_image_with_a_400(tiny_llama):
    app = create_app(make_llm(tiny_llama), api_keys=[KEY], served_model_name="tiny-llava", log_stats_interval=None)
    with running_server(app) as running:
        refused(chat(running.url, "Look", data_url(picture(0))), "takes no images")
        assert chat(running.url, "Hello").status_code == 200
        assert json.loads(requests.get(f"{running.url}/health", timeout=10).text or "{}") is not None


@pytest.mark.slow
def test_images_cross_to_an_engine_process_as_msgpack(server, tiny_llava):
    """The server's default: the engine core in its own process. The image's pixels, span and hash
    cross the wire inside the request; the answer is the in-process engine's."""
    from stage5_server.engine import MPAsyncLLM
    from tests.stage5.server_fixtures import ENGINE_KWARGS

    url, _ = server
    image = data_url(picture(8))
    engine = MPAsyncLLM(str(tiny_llava), log_stats_interval=None, startup_timeout_s=120,
                        **{**ENGINE_KWARGS, "dtype": "float32", "device": "cpu", "attention_backend": "torch",
                           "max_num_batched_tokens": 32})
    app = create_app(engine, api_keys=[KEY], served_model_name="tiny-llava", log_stats_interval=None)
    try:
        with running_server(app) as split:
            response = chat(split.url, "Describe", image)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"] == chat(url, "Describe", image).json()["choices"][0][
                "message"]
    finally:
        engine.shutdown()
