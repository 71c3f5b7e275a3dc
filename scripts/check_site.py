"""Open every page of the built site in headless Chromium, offline, and fail on what a reader would see broken.

    make docs && make docs-check                  # or:
    python scripts/check_site.py [--site site] [--screenshots build/site-screenshots]

The site is served from ``--site`` on a loopback port and every request to any other host is
refused and reported, so a page that needs the network (a CDN script, a web font) shows up as it
would for a reader offline. A page's HTML is also read for what it could fetch from elsewhere
without doing so on this visit (a script that imports a module from a CDN only when the page has
a diagram, say): every outside ``src``, stylesheet, ``import`` or CSS ``url(...)`` is a problem.
Each page is screenshotted (full page) and checked for:

- raw diagram text: a mermaid block that did not become an SVG;
- a squashed diagram: an SVG drawn at less than ``MIN_DIAGRAM_SCALE`` of its natural width,
  which makes its text unreadable;
- clipped blocks: a code block or table wider than the column it sits in (a horizontal
  scroll bar hides part of it), or a table cell wider than the page;
- a figure shrunk to less than ``1 / MAX_IMAGE_SHRINK`` of its pixel width;
- a script error or an error on the browser's console (a file that did not load is one);
- a replay of the inspector (``data-inspector="replay"``) that shows no step.

Chromium comes from the system (Debian's ``chromium`` package: ``apt-get install -y chromium``),
driven through the ``playwright`` Python package, so no browser is downloaded.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import re
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1280, "height": 900}  # a laptop screen
# The theme attaches each diagram's SVG to a closed shadow root; open it so the checks can see it.
INIT_JS = """
const attach = Element.prototype.attachShadow;
Element.prototype.attachShadow = function (init) { return attach.call(this, {...init, mode: 'open'}); };
"""
MIN_DIAGRAM_SCALE = 0.6
MAX_IMAGE_SHRINK = 2.2

# Runs in the page: everything a reader would find broken, as a list of strings.
PAGE_PROBLEMS_JS = """
([minScale, maxShrink]) => {
  const problems = [];
  const where = (el) => {
    const text = (el.innerText || el.textContent || '').trim().replace(/\\s+/g, ' ');
    return JSON.stringify(text.slice(0, 60));
  };
  // The theme draws each diagram into a shadow root of a div.mermaid (opened by INIT_JS).
  const diagrams = [];
  for (const el of document.querySelectorAll('.mermaid')) {
    const svg = (el.shadowRoot && el.shadowRoot.querySelector('svg')) || el.querySelector('svg');
    if (svg) diagrams.push(svg);
    else problems.push('raw mermaid text, not a diagram: ' + where(el));
  }
  for (const svg of diagrams) {
    const box = svg.viewBox && svg.viewBox.baseVal;
    const shown = svg.getBoundingClientRect().width;
    if (box && box.width > 0 && shown / box.width < minScale) {
      problems.push(`diagram drawn at ${(100 * shown / box.width).toFixed(0)}% of its size (text too small): `
                    + where(svg));
    }
  }
  const blocks = document.querySelectorAll(
    '.md-typeset pre > code, .md-typeset__scrollwrap, .jp-OutputArea-output pre, .jp-RenderedHTMLCommon table');
  for (const el of blocks) {
    if (el.scrollWidth > el.clientWidth + 2) {
      problems.push(`clipped: ${el.scrollWidth}px of content in ${el.clientWidth}px: ` + where(el));
    }
  }
  // Text output (tables, drawings) must fit unwrapped; code may wrap (copying it is unaffected).
  for (const code of document.querySelectorAll('.md-typeset pre > code')) {
    const block = code.closest('.highlight');
    const isText = block && /language-(text|console)/.test(block.className + ' ' + code.className);
    if (!isText) continue;
    const lines = code.textContent.replace(/\\n$/, '').split('\\n').length;
    const lineHeight = parseFloat(getComputedStyle(code).lineHeight);
    if (lineHeight && code.getBoundingClientRect().height > (lines + 0.5) * lineHeight + 30) {
      problems.push('text block wraps its lines (too wide for the page): ' + where(code));
    }
  }
  const column = document.querySelector('.md-content__inner') || document.body;
  const right = column.getBoundingClientRect().right;
  for (const el of document.querySelectorAll('.md-typeset table, .md-typeset img, .md-typeset pre')) {
    const r = el.getBoundingClientRect();
    if (r.width > 0 && r.right > right + 2 && !el.closest('.md-typeset__scrollwrap')) {
      problems.push(`wider than the page by ${Math.round(r.right - right)}px: ` + where(el));
    }
  }
  for (const img of document.querySelectorAll('.md-typeset img, .jp-OutputArea-output img')) {
    const shown = img.getBoundingClientRect().width;
    if (img.naturalWidth && shown && img.naturalWidth / shown > maxShrink) {
      const src = (img.getAttribute('src') || '').slice(0, 60);
      problems.push(`figure ${src} shrunk ${(img.naturalWidth / shown).toFixed(1)}x `
                    + `(${img.naturalWidth}px shown at ${Math.round(shown)}px)`);
    }
    if (!img.complete || img.naturalWidth === 0) {
      problems.push(`figure did not load: ${(img.getAttribute('src') || '').slice(0, 60)}`);
    }
  }
  // The inspector's replays (Watch the engine): each loaded its trace and shows a step.
  for (const viewer of document.querySelectorAll('[data-inspector="replay"]')) {
    const step = viewer.querySelector('.ssi-step');
    if (!step || !/^step \\d/.test(step.textContent)) {
      const notice = viewer.querySelector('.ssi-notice');
      problems.push(`replay ${viewer.getAttribute('data-trace')} shows no step`
                    + (notice && notice.textContent ? `: ${notice.textContent}` : ''));
    }
  }
  return problems;
}
"""


# What a page could fetch: a tag's src (script, img, iframe, source, ...), a link's href that is loaded
# (stylesheet, preload, modulepreload, icon, manifest), a JavaScript import, a CSS url(...).
_FETCHES = [
    re.compile(r"""<(?:script|img|iframe|source|embed|audio|video|track|input)\b"""
               r"""[^>]*?\ssrc\s*=\s*["']?(https?:)?//([^"'\s>]+)""", re.I),
    re.compile(r"""<link\b(?=[^>]*\srel\s*=\s*["']?[^"'>]*(?:stylesheet|preload|modulepreload|icon|manifest))"""
               r"""[^>]*?\shref\s*=\s*["']?(https?:)?//([^"'\s>]+)""", re.I),
    re.compile(r"""\bimport\s*\(\s*["'](https?:)?//([^"']+)""", re.I),
    re.compile(r"""\bimport\b[^;()"']*?\bfrom\s*["'](https?:)?//([^"']+)""", re.I),
    re.compile(r"""url\(\s*["']?(https?:)?//([^"')\s]+)""", re.I),
]
_LOCAL = ("127.0.0.1", "localhost")


def outside_references(html: str) -> list[str]:
    """Every address on another host that ``html`` could fetch, whether or not this visit does."""
    found = set()
    for pattern in _FETCHES:
        for match in pattern.finditer(html):
            address = match.group(2)
            if address.split("/")[0].split(":")[0] not in _LOCAL:
                found.add(f"{match.group(1) or ''}//{address}")
    return sorted(found)


def site_pages(site: Path) -> list[str]:
    """URL paths of every page mkdocs wrote (``index.html`` files), the 404 page excluded."""
    pages = []
    for index in sorted(site.rglob("index.html")):
        rel = index.parent.relative_to(site).as_posix()
        if rel.startswith(("assets", "search")):
            continue
        pages.append("/" if rel == "." else f"/{rel}/")
    return pages


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def check_site(site: Path, screenshots: Path | None, pages: list[str] | None = None) -> dict[str, list[str]]:
    """Problems per page path (empty lists for good pages)."""
    from playwright.sync_api import sync_playwright

    server, base = serve(site)
    problems: dict[str, list[str]] = {}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            context = browser.new_context(viewport=VIEWPORT)
            outside: list[str] = []

            def only_local(route):
                host = urlparse(route.request.url).hostname
                if host in ("127.0.0.1", "localhost"):
                    route.continue_()
                else:
                    outside.append(route.request.url)
                    route.abort()

            context.route("**/*", only_local)
            context.add_init_script(INIT_JS)
            page = context.new_page()
            errors: list[str] = []

            def console(message) -> None:
                if message.type == "error":
                    errors.append(f"console error: {message.text}")

            page.on("pageerror", lambda exc: errors.append(f"script error: {exc}"))
            page.on("console", console)
            for path in pages or site_pages(site):
                outside.clear()
                errors.clear()
                page.goto(base + path, wait_until="networkidle")
                page.wait_for_timeout(300)  # mermaid renders after the page's own scripts
                found = page.evaluate(PAGE_PROBLEMS_JS, [MIN_DIAGRAM_SCALE, MAX_IMAGE_SHRINK])
                found += [f"needs the network: {url}" for url in sorted(set(outside))]
                html = (site / path.strip("/") / "index.html").read_text(encoding="utf-8", errors="replace")
                found += [f"could fetch from elsewhere: {url}" for url in outside_references(html)]
                found += errors
                problems[path] = found
                if screenshots is not None:
                    name = path.strip("/").replace("/", "_") or "index"
                    screenshots.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(screenshots / f"{name}.png"), full_page=True)
            browser.close()
    finally:
        server.shutdown()
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site", type=Path, default=ROOT / "site", help="the built site (make docs)")
    parser.add_argument("--screenshots", type=Path, default=ROOT / "build" / "site-screenshots")
    parser.add_argument("pages", nargs="*", help="URL paths to check (default: every page)")
    args = parser.parse_args(argv)
    if not (args.site / "index.html").is_file():
        raise SystemExit(f"site: no built site at {args.site}; run make docs first")
    if not Path(CHROMIUM).is_file():
        raise SystemExit(f"chromium: {CHROMIUM} not found; install it with apt-get install -y chromium")
    missing = [page for page in args.pages if not (args.site / page.strip("/") / "index.html").is_file()]
    if missing:
        raise SystemExit(f"pages: not in the built site: {', '.join(missing)} (a page is a URL path, as /serving/)")
    problems = check_site(args.site, args.screenshots, args.pages or None)
    bad = {path: found for path, found in problems.items() if found}
    for path, found in problems.items():
        print(f"{'FAIL' if found else 'ok  '} {path}")
        for problem in found:
            print(f"       {problem}")
    print(f"{len(problems) - len(bad)}/{len(problems)} pages render cleanly; screenshots in {args.screenshots}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
