"""mkdocs hook: notebook pages take mermaid from the site itself, never from a CDN.

nbconvert's page template (which mkdocs-jupyter extends) imports mermaid's ES module from
cdnjs whenever a notebook has a diagram output, and the code that does so is on every notebook
page. The site already serves mermaid (``extra_javascript`` in ``mkdocs.yml``), which sets the
global ``window.mermaid``; this hook points the template's code at that instead, and drops the
optional ELK layout module, which the site does not serve. ``scripts/check_site.py`` fails on any
page that could still fetch from another host.
"""

from __future__ import annotations

import re

_MERMAID_IMPORT = re.compile(r"""\(await import\(\s*["']https?://[^"']*mermaid[^"']*["']\s*\)\)\.default""")
_ELK_URL = re.compile(r"""(const elkUrl\s*=\s*)["']https?://[^"']*["']""")


def on_post_page(output: str, page, config) -> str:
    output = _MERMAID_IMPORT.sub("window.mermaid", output)
    return _ELK_URL.sub(r'\1""', output)
