"""Media fetching probed as an attacker would: every spelling of a loopback or private address, the
same reached by a redirect from an allowed public host, other URL schemes, malformed and non-ASCII
URLs, corrupt images and decompression bombs, and many images in one request. Each is a 400 naming
the rule (never a 500, never a traceback), refused before the large allocation; the allowed path
still works (an accented path is fetched as a browser would ask for it). The tiny LLaVA behind the
real server; the media hosts are HTTP servers this test starts on 127.0.0.1, and "public.example" is
a name this test resolves to a public address that it routes to one of them."""

from __future__ import annotations

import base64
import http.server
import io
import socket
import struct
import types
import zlib
from urllib.parse import parse_qs, unquote, urlsplit

import pytest
import requests

import stage5_server.server.media as media_module
from tests.stage5.server_fixtures import LoopbackHTTPServer, auth, media_rules, running_server, tiny_llava_app
from tests.stage5.test_multimodal import data_url, picture

KEY = "test-key-media-probes"
PUBLIC_NAME, PUBLIC_ADDRESS = "public.example", "93.184.215.14"
PNG = io.BytesIO()
picture(11).save(PNG, format="PNG")
PNG = PNG.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_of(width: int, height: int, idat: bytes) -> bytes:
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


class Host(LoopbackHTTPServer):
    """An HTTP server on 127.0.0.1: ``/cat.png``, any path under ``/img/`` (the raw request target is
    recorded), and ``/redirect?to=URL``."""

    def __init__(self):
        self.targets: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(handler):
                self.targets.append(handler.path)
                path = urlsplit(handler.path).path
                if path == "/redirect":
                    handler.send_response(302)
                    handler.send_header("Location", parse_qs(urlsplit(handler.path).query)["to"][0])
                    handler.end_headers()
                elif path == "/cat.png" or unquote(path).startswith("/img/"):
                    handler.send_response(200)
                    handler.send_header("Content-Length", str(len(PNG)))
                    handler.end_headers()
                    handler.wfile.write(PNG)
                else:
                    handler.send_response(404)
                    handler.end_headers()

        super().__init__(Handler)


@pytest.fixture(scope="module")
def host():
    served = Host()
    yield served
    served.close()


@pytest.fixture(scope="module")
def server(tiny_llava):
    app = tiny_llava_app(tiny_llava, KEY)
    with running_server(app) as running:
        yield running.url, app.state.serving


media = media_rules


@pytest.fixture
def public_name(monkeypatch):
    """``public.example`` resolves to a public address, and a connection to it reaches 127.0.0.1 (the media
    module's view of the network; every other name and address is the real one)."""
    real = socket

    def getaddrinfo(host, port, *args, **kwargs):
        if host == PUBLIC_NAME:
            return [(real.AF_INET, real.SOCK_STREAM, 6, "", (PUBLIC_ADDRESS, port))]
        return real.getaddrinfo(host, port, *args, **kwargs)

    def create_connection(address, *args, **kwargs):
        if address[0] == PUBLIC_ADDRESS:
            address = ("127.0.0.1", address[1])
        return real.create_connection(address, *args, **kwargs)

    network = types.SimpleNamespace(getaddrinfo=getaddrinfo, create_connection=create_connection,
                                    SOCK_STREAM=real.SOCK_STREAM, gaierror=real.gaierror)
    monkeypatch.setattr(media_module, "socket", network)


def chat(url: str, *images: str, text: str = "Look") -> requests.Response:
    content = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": u}} for u in images)]
    body = {"model": "tiny-llava", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0}
    return requests.post(f"{url}/v1/chat/completions", json=body, headers=auth(KEY), timeout=60)


def refused(response: requests.Response, words: str, status: int = 400) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert "Traceback" not in response.text and 'File "' not in response.text


def healthy(url: str) -> None:
    assert chat(url, data_url(picture(1))).status_code == 200


# ---- URLs ----------------------------------------------------------------------------------------------

def test_a_non_ascii_path_on_an_allowed_host_is_fetched_percent_encoded_as_a_browser_asks(server, host):
    url, serving = server
    with media(serving, allowed_media_domains=("127.0.0.1",), allow_private_addresses=True):
        response = chat(url, f"{host.url}/img/café.png?name=Zoë")
        assert response.status_code == 200, response.text
        assert host.targets[-1] == "/img/caf%C3%A9.png?name=Zo%C3%AB"
        assert chat(url, f"{host.url}/img/caf%C3%A9.png").status_code == 200  # already encoded: sent as is
        assert host.targets[-1] == "/img/caf%C3%A9.png"
        assert chat(url, f"{host.url}/img/a\r\nX-Injected: 1").status_code == 200  # no header injection:
        assert host.targets[-1] == "/img/aX-Injected:%201"  # the URL parser drops CR and LF, the space is encoded
    healthy(url)


@pytest.mark.parametrize("image_url, words", [
    ("http://[::1/a.png", "malformed"),
    ("http://127.0.0.1:99999/a.png", "malformed"),
    ("http://127.0.0.1:port/a.png", "malformed"),
    ("http://exämple.test/a.png", "not in this server's --allowed-media-domains"),
    ("http://" + "a" * 70 + ".test/a.png", "not in this server's --allowed-media-domains"),
    ("http://xn--/a.png", "not in this server's --allowed-media-domains"),
    ("http:///a.png", "must be a data: URL or an http(s) URL"),
])
def test_malformed_and_international_urls_are_400s(server, image_url, words):
    url, serving = server
    with media(serving, allowed_media_domains=("127.0.0.1",)):
        refused(chat(url, image_url), words)
    healthy(url)


def test_an_allowed_international_name_is_compared_in_its_idna_form(server):
    url, serving = server
    with media(serving, allowed_media_domains=("exämple.test",)):
        refused(chat(url, "http://EXÄMPLE.test./a.png"), "does not resolve")  # allowed, and looked up
        refused(chat(url, "http://xn--exmple-cua.test/a.png"), "does not resolve")


LOOPBACK_SPELLINGS = ["127.1", "0x7f000001", "2130706433", "017700000001", "127.000.000.001", "localhost.",
                      "LOCALHOST", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]"]
PRIVATE_SPELLINGS = [*LOOPBACK_SPELLINGS, "[::1]", "0.0.0.0", "0", "169.254.169.254", "[fe80::1%25lo]",
                     "10.0.0.1", "[64:ff9b::a9fe:a9fe]", "[2002:7f00:1::]", "[fd00::1]"]


def host_name(spelling: str) -> str:
    """What the allowlist holds for a URL's host: the name, an IPv6 address without its brackets."""
    return urlsplit(f"http://{spelling}/").hostname


@pytest.mark.parametrize("spelling", PRIVATE_SPELLINGS)
def test_every_spelling_of_a_private_address_is_refused(server, host, spelling):
    url, serving = server
    image = f"http://{spelling}:{host.port}/cat.png"
    refused(chat(url, image), "--allowed-media-domains")  # not allowed: no lookup, no connection
    with media(serving, allowed_media_domains=(host_name(spelling),)):
        response = chat(url, image)
        assert response.status_code == 400, response.text
        assert any(words in response.json()["error"]["message"] for words in ("non-public address", "does not resolve"))


def test_the_embedded_ipv4_address_decides_for_ipv6_forms():
    import ipaddress

    from stage5_server.server.media import is_public_address

    for private in ("::ffff:127.0.0.1", "64:ff9b::7f00:1", "2002:a9fe:a9fe::", "2001:0:4136:e378:8000:63bf:80ff:fffe"):
        assert not is_public_address(ipaddress.ip_address(private)), private
    for public in ("93.184.215.14", "2606:2800:220:1::", "64:ff9b::5db8:d70e", "::ffff:93.184.215.14"):
        assert is_public_address(ipaddress.ip_address(public)), public


@pytest.mark.parametrize("spelling", ["127.1", "0x7f000001", "2130706433", "017700000001", "localhost."])
def test_the_operator_may_allow_a_private_host_in_any_spelling(server, host, spelling):
    url, serving = server
    with media(serving, allowed_media_domains=(host_name(spelling),), allow_private_addresses=True):
        response = chat(url, f"http://{spelling}:{host.port}/cat.png")
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("target", ["http://127.0.0.1:{port}/cat.png", "http://2130706433:{port}/cat.png",
                                    "http://[::ffff:127.0.0.1]:{port}/cat.png", "http://localhost.:{port}/cat.png",
                                    "http://169.254.169.254/latest/meta-data/", "file:///etc/passwd",
                                    "gopher://127.0.0.1:{port}/_GET", "/img/relative-ok.png"])
def test_a_redirect_from_an_allowed_public_host_passes_every_rule_again(server, host, public_name, target):
    url, serving = server
    target = target.format(port=host.port)
    allowed = (PUBLIC_NAME, "127.0.0.1", "2130706433", "::ffff:127.0.0.1", "localhost", "169.254.169.254")
    with media(serving, allowed_media_domains=allowed, allow_redirects=True):
        assert chat(url, f"http://{PUBLIC_NAME}:{host.port}/cat.png").status_code == 200  # the public host itself
        response = chat(url, f"http://{PUBLIC_NAME}:{host.port}/redirect?to={target}")
        if target.startswith("/"):  # a relative redirect stays on the public host: fetched
            assert response.status_code == 200, response.text
            return
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "non-public address" in message or "must be a data: URL or an http(s) URL" in message, message
    healthy(url)


# ---- schemes and data URLs ----------------------------------------------------------------------------

@pytest.mark.parametrize("image_url, words", [
    ("file:///etc/passwd", "must be a data: URL or an http(s) URL"),
    ("ftp://127.0.0.1/a.png", "must be a data: URL or an http(s) URL"),
    ("gopher://127.0.0.1:70/_x", "must be a data: URL or an http(s) URL"),
    ("javascript:alert(1)", "must be a data: URL or an http(s) URL"),
    ("", "must be a data: URL or an http(s) URL"),
    ("DATA:image/png;base64,aGVsbG8=", "must be a data: URL or an http(s) URL"),
    ("data:text/html;base64,PGgxPmhpPC9oMT4=", "is not an image"),
    ("data:image/svg+xml;base64,PHN2Zy8+", "not an image this server can read"),
    ("data:image/png,rawbytes", "only base64 data URLs"),
    ("data:image/png;base64", "a data URL must read"),
    ("data:image/png;base64,", "not an image this server can read"),
])
def test_other_schemes_and_bad_data_urls_are_400s(server, image_url, words):
    url, _ = server
    refused(chat(url, image_url), words)


def test_a_huge_data_url_is_refused_by_the_body_cap(server):
    url, _ = server
    payload = base64.b64encode(b"\0" * (6 << 20)).decode()
    response = chat(url, f"data:image/png;base64,{payload}")
    assert response.status_code == 413, response.text
    assert "exceeds the limit" in response.json()["error"]["message"]
    healthy(url)


# ---- corrupt images and bombs ---------------------------------------------------------------------------

def corrupt_images() -> dict[str, bytes]:
    from PIL import Image

    gif = io.BytesIO()
    picture(2).save(gif, format="GIF")
    jpeg = io.BytesIO()
    picture(2).save(jpeg, format="JPEG")
    broken_idat = bytearray(PNG)
    at = PNG.index(b"IDAT") + 8
    broken_idat[at:at + 8] = b"\xff" * 8  # the zlib stream and the chunk's CRC no longer match
    bad_crc, idat = bytearray(PNG), PNG.index(b"IDAT")
    bad_crc[idat + 4 + struct.unpack(">I", PNG[idat - 4:idat])[0]] ^= 1  # the IDAT chunk's CRC
    return {
        "truncated png": PNG[:len(PNG) // 2],
        "png with a broken zlib stream": bytes(broken_idat),
        "png with a bad crc": bytes(bad_crc),
        "png of zero width": png_of(0, 10, zlib.compress(b"\0" * 10)),
        "png whose rows are missing": png_of(64, 64, zlib.compress(b"\0" * 10)),
        "truncated gif": gif.getvalue()[:40],
        "truncated jpeg": jpeg.getvalue()[:200],
        "a bmp header only": b"BM" + struct.pack("<IHHI", 0, 0, 0, 54) + struct.pack("<IiiHHIIiiII", 40, 4, 4, 1,
                                                                                 24, 0, 0, 0, 0, 0, 0),
        "gif header claiming 65535x65535": b"GIF89a" + struct.pack("<HH", 65535, 65535) + b"\0\0\0;",
        "an ico": _ico(Image),
    }


def _ico(Image) -> bytes:
    out = io.BytesIO()
    picture(3).resize((16, 16)).save(out, format="ICO")
    return out.getvalue()[:30]


@pytest.mark.parametrize("name", list(corrupt_images()))
def test_corrupt_images_are_400s(server, name):
    url, _ = server
    data = corrupt_images()[name]
    response = chat(url, "data:image/png;base64," + base64.b64encode(data).decode())
    assert response.status_code in (200, 400), response.text  # a lenient decoder may still read it
    if response.status_code == 400:
        assert "image_url" in response.json()["error"]["message"]
        assert "Traceback" not in response.text


@pytest.mark.parametrize("width, height", [(65535, 65535), (1 << 25, 1), (1, 1 << 25), (20000, 20000), (5000, 5000)])
def test_a_bomb_is_refused_from_its_declared_size_before_decoding(server, width, height):
    url, _ = server
    bomb = png_of(width, height, zlib.compress(b"\0" * 1024))  # a kilobyte that claims gigapixels
    refused(chat(url, "data:image/png;base64," + base64.b64encode(bomb).decode()), "pixels")
    healthy(url)


# ---- many images -----------------------------------------------------------------------------------------

def test_many_images_are_counted_across_messages_before_any_is_loaded(server, host):
    url, serving = server
    hits = len(host.targets)
    with media(serving, allowed_media_domains=("127.0.0.1",), allow_private_addresses=True):
        refused(chat(url, *[f"{host.url}/img/{i}.png" for i in range(9)]), "more than the 8 this server allows")
        messages = [{"role": "user" if i % 2 == 0 else "assistant",
                     "content": [{"type": "image_url", "image_url": {"url": f"{host.url}/img/m{i}.png"}}]}
                    for i in range(9)]
        body = {"model": "tiny-llava", "messages": messages, "max_tokens": 2}
        response = requests.post(f"{url}/v1/chat/completions", json=body, headers=auth(KEY), timeout=60)
        refused(response, "more than the 8 this server allows")
        refused(chat(url, *[data_url(picture(0))] * 100), "more than the 8 this server allows")
    assert len(host.targets) == hits  # nothing was fetched
    healthy(url)


def test_tokenize_counts_images_as_the_request_would(server):
    url, _ = server
    part = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
    response = requests.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": [part] * 100}]},
                             headers=auth(KEY), timeout=60)
    refused(response, "more than the 8 this server allows")
    response = requests.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": [part] * 8}]},
                             headers=auth(KEY), timeout=60)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("width, height", [(1, 30_000), (30_000, 1), (2, 20_000)])
def test_a_strip_that_the_resize_would_blow_up_is_refused(server, monkeypatch, width, height):
    """Under the pixel limit as sent, but the processor keeps the aspect ratio as it resizes the shortest edge
    to 40 (336 for CLIP): 1 x 30000 becomes 40 x 1200000, 48 megapixels of floats."""
    from PIL import Image

    url, _ = server
    monkeypatch.setenv("VLLM_MAX_IMAGE_PIXELS", str(1 << 20))
    strip = io.BytesIO()
    Image.new("RGB", (width, height)).save(strip, format="PNG")
    refused(chat(url, "data:image/png;base64," + base64.b64encode(strip.getvalue()).decode()), "aspect ratio")
    square = io.BytesIO()
    Image.new("RGB", (1000, 1000)).save(square, format="PNG")  # a million pixels, resized to 40 x 40
    assert chat(url, "data:image/png;base64," + base64.b64encode(square.getvalue()).decode()).status_code == 200


def test_a_trusted_request_cannot_resize_an_image_past_the_pixel_limit(server):
    url, serving = server
    content = [{"type": "text", "text": "Look"}, {"type": "image_url", "image_url": {"url": data_url(picture(4))}}]
    body = {"model": "tiny-llava", "messages": [{"role": "user", "content": content}], "max_tokens": 2,
            "mm_processor_kwargs": {"size": {"shortest_edge": 100_000}}}  # 10 gigapixels of floats
    with media(serving, trust_request_mm_kwargs=True):
        response = requests.post(f"{url}/v1/chat/completions", json=body, headers=auth(KEY), timeout=60)
    refused(response, "VLLM_MAX_IMAGE_PIXELS")
    healthy(url)
