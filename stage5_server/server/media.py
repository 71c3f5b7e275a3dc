"""Loading the images a request names, safe by default: a media URL is an input capability.

An ``image_url`` part may hold a ``data:`` URL (the image itself, base64) or an ``http(s)`` URL
that this server fetches. Fetching on a caller's behalf lets the caller reach what the server
can reach (server-side request forgery), make it download without end, or hand it a small file
that decodes into gigabytes. So every fetch passes these rules, and each refusal is a 400:

- **an allowlist**: no remote URL is fetched unless its host is one of ``--allowed-media-domains``
  (exact names; none by default, so only ``data:`` URLs work);
- **no redirects** unless ``VLLM_MEDIA_URL_ALLOW_REDIRECTS=1``, and then each hop passes every rule
  again (a redirect is how an allowed host would send the server elsewhere);
- **no private addresses**: the host name is resolved once, every address it resolves to must be
  public (not loopback, private, link-local, reserved, multicast or unspecified, nor an IPv6 address
  carrying such an IPv4 one: mapped, 6to4, Teredo, NAT64) unless the operator passes
  ``--allow-private-media-addresses``, and the connection goes to that checked address (a second
  lookup could answer differently: DNS rebinding);
- **one spelling of a URL**: a malformed URL is a 400; the host is compared in its ASCII form (lower
  case, no trailing dot, IDNA for an international name), and a non-ASCII path or query is sent
  percent-encoded as UTF-8, as a browser sends it;
- **caps**: at most ``VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB`` bytes read (counted while streaming;
  ``Content-Length`` is not trusted), the whole fetch within ``VLLM_IMAGE_FETCH_TIMEOUT`` seconds,
  and at most ``VLLM_MAX_IMAGE_PIXELS`` pixels, checked from the file's header before decoding
  (``multimodal/image_io.py``);
- **a count**: at most ``--max-images-per-request`` images in one request (each is fetched, decoded
  and run through the vision tower), ``/tokenize`` included (each becomes its placeholder tokens);
- **per-request processor settings** (``mm_processor_kwargs``, ``media_io_kwargs``) are refused
  unless ``--trust-request-mm-kwargs`` (``check_request_mm_kwargs``).

A request's URLs are each fetched once (``RequestMediaLoader`` remembers them), on a worker
thread, so a slow host never holds up the event loop.

vLLM: ``MediaConnector`` in ``vllm/multimodal/utils.py``, ``HTTPConnection`` in
``vllm/connections.py``, the variables in ``vllm/envs.py``; the checklist is vLLM's security page.
"""

from __future__ import annotations

import http.client
import ipaddress
import os
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

from stage5_server.multimodal.image_io import decode_data_url, load_image
from stage5_server.server.errors import APIError

MAX_REDIRECTS = 5
URL_SAFE = "/%:@!$&'()*+,;=~?"  # what stays as is in a request target; everything else (UTF-8) is %-encoded


def _ascii_host(name: str) -> str:
    """A host name as the allowlist compares it: lower case, no trailing dot (``example.com.`` is
    ``example.com``), IDNA for a non-ASCII name; a ``UnicodeError`` for a name IDNA cannot spell."""
    name = name.strip().lower().removesuffix(".")
    return name if name.isascii() else name.encode("idna").decode("ascii")


@dataclass(frozen=True)
class MediaOptions:
    """The operator's media settings: flags here, caps from vLLM's environment variables."""

    allowed_media_domains: tuple[str, ...] = ()  # hosts remote media may come from; empty: data URLs only
    allow_private_addresses: bool = False  # loopback, private, link-local hosts (a trusted network only)
    trust_request_mm_kwargs: bool = False  # a request's mm_processor_kwargs / media_io_kwargs
    allow_redirects: bool = False  # VLLM_MEDIA_URL_ALLOW_REDIRECTS
    max_download_bytes: int = 50 * 1024 * 1024  # VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB (vLLM's default: 256); 0: none
    fetch_timeout_s: float = 5.0  # VLLM_IMAGE_FETCH_TIMEOUT
    max_images_per_request: int = 8  # --max-images-per-request (vLLM: --limit-mm-per-prompt '{"image": N}')

    @classmethod
    def from_env(cls, **flags: Any) -> MediaOptions:
        env = os.environ
        return cls(allow_redirects=env.get("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0").lower() in ("1", "true"),
                   max_download_bytes=int(float(env.get("VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB", "50")) * 1024 * 1024),
                   fetch_timeout_s=float(env.get("VLLM_IMAGE_FETCH_TIMEOUT", "5")),
                   **{k: tuple(v) if k == "allowed_media_domains" else v for k, v in flags.items()})


def check_request_mm_kwargs(options: MediaOptions, mm_processor_kwargs: dict | None,
                            media_io_kwargs: dict | None) -> None:
    for name, value in (("mm_processor_kwargs", mm_processor_kwargs), ("media_io_kwargs", media_io_kwargs)):
        if value and not options.trust_request_mm_kwargs:
            raise APIError(400, f"{name}: this server does not accept per-request processor settings (start it "
                           "with --trust-request-mm-kwargs to allow them)", param=name)
    if media_io_kwargs:
        raise APIError(400, "media_io_kwargs: no media I/O settings apply to images on this server",
                       param="media_io_kwargs")


def refuse(message: str) -> APIError:
    return APIError(400, message, param="image_url", code="media_refused")


class MediaConnector:
    def __init__(self, options: MediaOptions):
        self.options = options
        self.allowed = frozenset(_ascii_host(d) for d in options.allowed_media_domains)

    def load_image(self, url: str):
        """The image at ``url`` (data or http(s)), or a 400 saying which rule refused it."""
        if url.startswith("data:"):
            try:
                return load_image(decode_data_url(url))
            except ValueError as exc:
                raise refuse(str(exc)) from None
        data = self.fetch(url)
        try:
            return load_image(data)
        except ValueError as exc:
            raise refuse(str(exc)) from None

    def fetch(self, url: str) -> bytes:
        deadline = time.monotonic() + self.options.fetch_timeout_s
        for _ in range(MAX_REDIRECTS + 1):
            status, location, body = self._get(url, deadline)
            if status in (301, 302, 303, 307, 308):
                if not self.options.allow_redirects:
                    raise refuse(f"image_url: {url} redirects (HTTP {status}); this server follows no redirects "
                                 "(VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)")
                if not location:
                    raise refuse(f"image_url: {url} redirects without a Location")
                url = urljoin(url, location)  # the next hop passes every rule again
                continue
            if status != 200:
                raise refuse(f"image_url: fetching {url} failed with HTTP {status}")
            return body
        raise refuse(f"image_url: more than {MAX_REDIRECTS} redirects")

    def _get(self, url: str, deadline: float) -> tuple[int, str | None, bytes]:
        scheme, host, port, target = self._parse(url)
        if host not in self.allowed:
            raise refuse(f"image_url: the host {host!r} is not in this server's --allowed-media-domains")
        address = self._checked_address(host, port)
        timeout = max(0.001, deadline - time.monotonic())
        cls = _PinnedHTTPSConnection if scheme == "https" else _PinnedHTTPConnection
        conn = cls(host, port, address, timeout)
        try:
            conn.request("GET", target, headers={"User-Agent": "stagedserve"})
            response = conn.getresponse()
            if response.status != 200:
                return response.status, response.getheader("Location"), b""
            return 200, None, self._read_capped(response, conn, deadline)
        except TimeoutError:
            raise refuse(f"image_url: fetching {url} took longer than {self.options.fetch_timeout_s} s "
                         "(VLLM_IMAGE_FETCH_TIMEOUT)") from None
        except (OSError, http.client.HTTPException) as exc:
            raise refuse(f"image_url: fetching {url} failed ({type(exc).__name__})") from None
        finally:
            conn.close()

    @staticmethod
    def _parse(url: str) -> tuple[str, str, int, str]:
        """``url``'s scheme, host (ASCII: an international name in its IDNA form, no trailing dot), port
        and request target, the path and query percent-encoded as a browser sends them (UTF-8)."""
        try:
            parts = urlsplit(url)
            port = parts.port  # a ValueError for a port that is not a number in 0..65535
        except ValueError:
            raise refuse("image_url: the URL is malformed") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise refuse("image_url: must be a data: URL or an http(s) URL")
        try:
            host = _ascii_host(parts.hostname)
        except UnicodeError:
            raise refuse("image_url: the host name is not a valid international domain name") from None
        target = quote(parts.path or "/", safe=URL_SAFE) + (f"?{quote(parts.query, safe=URL_SAFE)}"
                                                            if parts.query else "")
        return parts.scheme, host, port or (443 if parts.scheme == "https" else 80), target

    def _read_capped(self, response: http.client.HTTPResponse, conn: _PinnedHTTPConnection,
                     deadline: float) -> bytes:
        cap, chunks, total = self.options.max_download_bytes, [], 0
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            conn.socket.settimeout(remaining)  # the response may have taken ``conn.sock`` over
            chunk = response.read1(64 * 1024)
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if 0 < cap < total:
                raise refuse(f"image_url: the download passed {cap} bytes (VLLM_MAX_MEDIA_DOWNLOAD_SIZE_MB)")
            chunks.append(chunk)

    def _checked_address(self, host: str, port: int) -> str:
        """One address of ``host``, after every address it resolves to has been checked."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            raise refuse(f"image_url: the host {host!r} does not resolve") from None
        addresses = [info[4][0] for info in infos]
        if not self.options.allow_private_addresses:
            for address in addresses:
                if not is_public_address(ipaddress.ip_address(address.split("%")[0])):  # ``%``: an IPv6 zone
                    raise refuse(f"image_url: the host {host!r} resolves to {address}, a non-public address "
                                 "(start the server with --allow-private-media-addresses to allow it)")
        return addresses[0]


NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052: an IPv4 address in the last 32 bits


def is_public_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Global and not multicast; an IPv6 address that carries an IPv4 one (mapped, 6to4, Teredo, NAT64)
    is public only if that IPv4 address is too (``[::ffff:127.0.0.1]``, ``[64:ff9b::a9fe:a9fe]``)."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None and not is_public_address(embedded):
            return False
    return ip.is_global and not ip.is_multicast


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to the address that was checked, not to a fresh lookup of the name."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = self.socket = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self.socket = self._context.wrap_socket(sock, server_hostname=self.host)  # the name's certificate


def check_image_count(options: MediaOptions, count: int) -> None:
    """Refuse a request with more images than the server allows, before any is loaded."""
    if count > options.max_images_per_request:
        raise refuse(f"image_url: {count} images in one request, more than the {options.max_images_per_request} "
                     "this server allows (--max-images-per-request)")


class RequestMediaLoader:
    """One request's images: each URL fetched once, however often the request names it."""

    def __init__(self, connector: MediaConnector):
        self.connector = connector
        self.loaded: dict[str, Any] = {}

    def __call__(self, part: dict):
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise refuse("image_url: expected {'url': a data: or http(s) URL}")
        if url not in self.loaded:
            self.loaded[url] = self.connector.load_image(url)
        return self.loaded[url]
