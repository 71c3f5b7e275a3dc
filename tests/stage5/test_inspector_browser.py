"""The inspector's page in a real browser: the system's chromium through playwright, as the site check drives it
(``apt-get install -y chromium``; no browser is downloaded). A live server's ``/inspect``, opened with an API key,
and every replay of the course."""

from __future__ import annotations

import functools
import http.server
import json
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from stage5_server.server import create_app
from tests.stage5.server_fixtures import REPO, make_llm, running_server

pytest.importorskip("playwright")
CHROMIUM = "/usr/bin/chromium"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason="needs the system chromium")]

# Two API keys in two trust groups (a shared two-group fixture can take their place: only KEYS is used).
KEYS = {"teamA": "browser-key-a", "teamB": "browser-key-b"}
MARKUP = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        instance = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        yield instance
        instance.close()


@pytest.fixture(scope="module")
def server(tiny_llama):
    llm = make_llm(tiny_llama, enable_inspector=True, num_kv_blocks=64, block_size=16)
    app = create_app(llm, api_keys={key: group for group, key in KEYS.items()}, served_model_name="tiny",
                     log_stats_interval=None)
    with running_server(app) as running:
        yield running.url


def open_page(browser, url: str, key: str | None):
    """A page of ``/inspect`` in a fresh browser context that answers the key prompt with ``key``, and the
    problems the browser reported on it (script errors, console errors: a blocked inline script is one)."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000},
                                  **({"http_credentials": {"username": "me", "password": key}} if key else {}))
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"script error: {exc}"))
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    response = page.goto(f"{url}/inspect")
    return context, page, response, problems


def counts(page) -> str:
    return page.inner_text(".ssi-main .ssi-counts")


def wait_for(page, predicate, timeout: float = 30.0) -> None:
    """Poll ``predicate(page)`` from here: the page's policy forbids the string evaluation ``wait_for_function``
    does inside it."""
    deadline = time.monotonic() + timeout
    while not predicate(page):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {predicate.__doc__ or predicate}")
        page.wait_for_timeout(25)


def models_listed(page) -> bool:
    """the chat pane listed the models"""
    return page.eval_on_selector_all(".ssi-chat select option", "els => els.length") > 0


def chat_done(page) -> bool:
    """the chat pane finished its request"""
    return not page.eval_on_selector("form.ssi-chatform button[type=submit]", "b => b.disabled")


def chat(page, text: str, max_tokens: int, min_tokens: int = 0) -> None:
    page.fill("input[name=max_tokens]", str(max_tokens))
    page.fill("input[name=min_tokens]", str(min_tokens))
    page.fill("input[name=temperature]", "0")
    page.fill("textarea", text)
    page.click("form.ssi-chatform button[type=submit]")


def test_a_chat_sent_from_the_page_streams_and_its_blocks_go_from_free_to_used_to_cached(browser, server):
    context, page, response, problems = open_page(browser, server, KEYS["teamA"])
    try:
        assert response.status == 200
        wait_for(page, models_listed)  # /v1/models, with the key the browser holds
        assert "used" not in counts(page)  # a fresh server: no step yet, every block free
        # min_tokens: the random checkpoint would end its answer after a few tokens.
        chat(page, "Tell me a long story about paged attention.", 200, min_tokens=200)
        wait_for(page, lambda p: re.search(r"\b[1-9]\d* used", counts(p)))  # the request's blocks, while it runs
        streamed = []
        while not chat_done(page):
            streamed.append(len(page.inner_text(".ssi-assistant")))
            page.wait_for_timeout(20)
        final = len(page.inner_text(".ssi-assistant"))
        assert any(0 < n < final for n in streamed)  # part of the answer was on the page while the rest came
        wait_for(page, lambda p: re.search(r"\b0 used, [1-9]\d* cached", counts(p)))  # done: free, still cached
        assert "Tell me a long story about paged attention." in page.inner_text(".ssi-requests")  # own text
        bars = page.eval_on_selector_all(".ssi-timeline rect", "els => els.length")
        assert bars > 10  # a prefill bar and a decode bar per step
        assert problems == []
    finally:
        context.close()


def test_markup_in_a_prompt_and_in_model_output_shows_as_text_and_runs_nothing(browser, server):
    context, page, _, problems = open_page(browser, server, KEYS["teamA"])

    def answer_with_markup(route):
        """The page's own chat request, held by a grammar to one answer: the model's output is ``MARKUP``."""
        body = json.loads(route.request.post_data)
        route.continue_(post_data=json.dumps({**body, "structured_outputs": {"choice": [MARKUP]}}))

    try:
        page.route("**/v1/chat/completions", answer_with_markup)
        wait_for(page, models_listed)
        chat(page, f"Repeat after me: {MARKUP}", 96)
        wait_for(page, chat_done, 60)
        assert page.inner_text(".ssi-assistant") == MARKUP  # the streamed answer, as text
        assert MARKUP in page.inner_text(".ssi-user")  # the prompt in the chat pane, as text
        # The inspector's own-request pane: the prompt and the output the hub sent on the step stream, as text.
        wait_for(page, lambda p: p.inner_text(".ssi-requests").count(MARKUP) >= 2)
        assert page.evaluate("window.__pwned === undefined")
        assert page.eval_on_selector_all("img, iframe, object, embed", "els => els.length") == 0
        assert page.eval_on_selector_all("script", "els => els.map(s => s.src)") == [
            page.url.replace("/inspect", "/inspect/static/inspector.js")]
        assert problems == []
    finally:
        context.close()


def test_without_the_key_the_page_is_refused(browser, server):
    from playwright.sync_api import Error

    for key in (None, "not-a-key"):
        context = browser.new_context(**({"http_credentials": {"username": "me", "password": key}} if key else {}))
        try:
            response = context.request.get(f"{server}/inspect")  # the answer itself
            assert response.status == 401 and "data-inspector" not in response.text()
            assert 'Basic realm="stagedserve"' in response.headers["www-authenticate"]
            page = context.new_page()
            try:  # the browser, refused, gives up (no key to offer) or shows the 401 (a wrong one): no page
                assert page.goto(f"{server}/inspect").status == 401
            except Error as exc:
                assert "ERR_INVALID_AUTH_CREDENTIALS" in str(exc)
        finally:
            context.close()


# ---- the course's replays ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replay_site(tmp_path_factory):
    """The viewer and the committed traces laid out as the course site has them, one page per replay, served on a
    loopback port."""
    site = tmp_path_factory.mktemp("site")
    (site / "assets" / "inspector").mkdir(parents=True)
    for name in ("inspector.js", "inspector.css"):
        shutil.copy(REPO / "stage5_server" / "inspector" / "static" / name, site / "assets" / "inspector" / name)
    shutil.copytree(REPO / "docs" / "assets" / "replays", site / "assets" / "replays")
    names = sorted(p.stem for p in (site / "assets" / "replays").glob("*.json"))
    head = ('<!doctype html><html><head><meta charset="utf-8"><link rel="icon" href="data:,"><link rel="stylesheet" '
            'href="/assets/inspector/inspector.css"><script src="/assets/inspector/inspector.js"></script></head>')
    for name in names:
        (site / f"{name}.html").write_text(f'{head}<body><div data-inspector="replay" data-trace="{name}"></div>'
                                           f'</body></html>')
    (site / "loader.html").write_text(f'{head}<body><div data-inspector="loader"></div></body></html>')
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", names
    finally:
        httpd.shutdown()


def test_every_replay_of_the_course_plays_to_its_end_without_a_console_error(browser, replay_site):
    url, names = replay_site
    assert {"worked_example", "worked_example_apc", "stage1_slab", "stage2_blocks", "preemption",
            "speculative"} <= set(names)
    context = browser.new_context(viewport={"width": 900, "height": 900})
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"script error: {exc}"))
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    try:
        for name in names:
            steps = len(json.loads((REPO / "docs" / "assets" / "replays" / f"{name}.json").read_text())["steps"])
            page.goto(f"{url}/{name}.html", wait_until="networkidle")
            wait_for(page, lambda p: p.inner_text(".ssi-step").startswith("step 1 "))
            for _ in range(3):
                page.click("button[aria-label='next step']")
            page.click("button[aria-label='last step']")
            assert re.search(rf"\({steps} of {steps}\)", page.inner_text(".ssi-step")), name
            page.hover(".ssi-grid")
            assert page.inner_text(".ssi-hover").startswith("block "), name
            page.click("button[aria-label='first step']")
            assert problems == [], (name, problems)
        page.goto(f"{url}/loader.html", wait_until="networkidle")  # a learner's own trace, from a file
        page.set_input_files("input[type=file]", str(REPO / "docs" / "assets" / "replays" / "preemption.json"))
        wait_for(page, lambda p: p.query_selector(".ssi-step") and p.inner_text(".ssi-step").startswith("step 1 "))
        assert "Preemption" in page.inner_text(".ssi-title") and problems == []
    finally:
        context.close()
