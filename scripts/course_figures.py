"""The course's hand-made diagrams, drawn as SVG from the data they show.

    .venv/bin/python scripts/course_figures.py          # write every figure into docs/assets/
    .venv/bin/python scripts/course_figures.py --check  # exit 1 if a committed figure differs

- ``lora_padded_batch.svg`` (the LoRA page, and the ``lora_delta`` exercise): a step's token rows
  for two adapters and the base model, laid out as the padded batch of segments that one batched
  shrink and one batched expand work on, with the stacked shapes of ``LoRALinearMethod._add_padded``.
- ``spec_decode_rollback.svg`` (the speculative-decoding page): R0's verify step from
  ``docs/snippets/spec_decode_trace.txt``: four positions written, one draft rejected,
  ``num_computed_tokens`` rolled back past it, the stale slot overwritten in the next step.

Plain SVG (no script, no font files): the site shows it offline, a forge shows it as an image.
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "docs" / "assets"
FONT = "font-family='DejaVu Sans Mono, Menlo, Consolas, monospace'"
COLORS = {"sql": "#2a9d8f", "chat": "#e9c46a", "base": "#dddddd", "pad": "#ffffff", "old": "#b8c4d6",
          "new": "#5b8fd9", "stale": "#e76f51", "edge": "#333333"}


def _text(x: float, y: float, s: str, size: int = 12, anchor: str = "start", weight: str = "normal",
          fill: str = "#111") -> str:
    s = html.escape(s, quote=False)
    return (f"<text x='{x:g}' y='{y:g}' font-size='{size}' text-anchor='{anchor}' font-weight='{weight}' "
            f"fill='{fill}' {FONT}>{s}</text>")


def _box(x: float, y: float, w: float, h: float, fill: str, label: str = "", dashed: bool = False,
         hatch: bool = False, size: int = 12) -> str:
    dash = " stroke-dasharray='4 3'" if dashed else ""
    parts = [f"<rect x='{x:g}' y='{y:g}' width='{w:g}' height='{h:g}' fill='{fill}' stroke='{COLORS['edge']}'"
             f" stroke-width='1'{dash}/>"]
    if hatch:
        parts.append(f"<rect x='{x:g}' y='{y:g}' width='{w:g}' height='{h:g}' fill='url(#hatch)'/>")
    if label:
        parts.append(_text(x + w / 2, y + h / 2 + size / 3, label, size, "middle"))
    return "".join(parts)


def _svg(width: int, height: int, body: list[str], title: str) -> str:
    defs = ("<defs><pattern id='hatch' width='6' height='6' patternUnits='userSpaceOnUse' "
            "patternTransform='rotate(45)'><line x1='0' y1='0' x2='0' y2='6' stroke='#333' stroke-width='1.2'/>"
            "</pattern><marker id='arrow' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='7' markerHeight='7' "
            "orient='auto-start-reverse'><path d='M0,0 L10,5 L0,10 z' fill='#333'/></marker></defs>")
    label = html.escape(title, quote=True)
    return (f"<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {width} {height}' width='{width}' "
            f"height='{height}' role='img' aria-label=\"{label}\">\n<title>{label}</title>\n{defs}\n"
            f"<rect width='{width}' height='{height}' fill='white'/>\n" + "\n".join(body) + "\n</svg>\n")


def _arrow(x1: float, y1: float, x2: float, y2: float) -> str:
    return (f"<line x1='{x1:g}' y1='{y1:g}' x2='{x2:g}' y2='{y2:g}' stroke='#333' stroke-width='1.2' "
            f"marker-end='url(#arrow)'/>")


def lora_padded_batch() -> str:
    """Seven token rows: sql (slot 0) on rows 0-2, chat (slot 1) on rows 3 and 6, the base model on 4-5."""
    rows = ["sql", "sql", "sql", "chat", "base", "base", "chat"]
    segments = [("sql", 0, [0, 1, 2], [1, 1, 1]), ("chat", 1, [3, 6, 3], [1, 1, 0])]
    h, w = 24, 92
    body = [_text(20, 24, "x [T = 7, in]", 13, weight="bold")]
    top = 48
    for t, kind in enumerate(rows):
        name = {"sql": "sql, slot 0", "chat": "chat, slot 1", "base": "base model"}[kind]
        body.append(_box(20, top + t * h, w + 40, h, COLORS[kind], f"row {t}: {name}", size=11))
    body.append(_text(20, top + 7 * h + 22, "rows 4, 5: no segment,", 11))
    body.append(_text(20, top + 7 * h + 38, "never written", 11))

    x0 = 250
    body.append(_text(x0, 24, "padded batch xs [S = 2, L = 3, in]", 13, weight="bold"))
    body.append(_text(x0 + 330, 24, "scaling [S, L, 1]", 13, weight="bold"))
    for s, (kind, slot, idx, scale) in enumerate(segments):
        y = top + s * (3 * h + 30)
        body.append(_text(x0, y - 5, f"segment {s}: slot {slot} ({kind})", 11))
        for j, (row, on) in enumerate(zip(idx, scale)):
            padding = kind == "chat" and j == 2
            label = f"x[{row}]" + (" (padding: a copy)" if padding else "")
            body.append(_box(x0, y + j * h, 250, h, COLORS["pad"] if padding else COLORS[kind], label,
                             dashed=padding, size=11))
            body.append(_box(x0 + 330, y + j * h, 110, h, COLORS["pad"],
                             f"alpha/r of {slot}" if on else "0", size=11))
        for j, row in enumerate(idx):
            body.append(_arrow(20 + w + 40, top + row * h + h / 2, x0 - 4, y + j * h + h / 2))

    y = top + 2 * (3 * h + 30) + 10
    lines = [
        "shrink: bmm(xs, A_s^T)   A_s = stacked_a[slots]  [S, R, in]   ->  [S, L, R]",
        "expand: bmm(.., B_s)     B_s = stacked_b[slots]  [S, R, out]  ->  [S, L, out]",
        "times scaling, then out.index_add_(0, padded_rows = [0 1 2 3 6 3], delta)",
        "the padding row adds 0 to row 3; a slot's A and B are zero past its rank",
    ]
    for i, line in enumerate(lines):
        body.append(_text(x0, y + i * 18, line, 11))
    return _svg(760, y + 4 * 18 + 6, body, "LoRA: the step's rows as a padded batch of segments")


def spec_decode_rollback() -> str:
    """R0's verify step: A B C D E F A B, then C sampled and D E F drafted; the target says D E Z."""
    tokens = list("ABCDEFABCDEF")
    cell, left = 44, 150

    def row(y: float, label: str, letters: list[str], states: list[str], note: str = "") -> list[str]:
        out = [_text(12, y + 20, label, 12, weight="bold")]
        for i, (letter, state) in enumerate(zip(letters, states)):
            x = left + i * cell + (i // 4) * 8  # a gap between blocks
            fill = {"kv": COLORS["old"], "new": COLORS["new"], "none": COLORS["pad"], "stale": COLORS["stale"],
                    "draft": COLORS["pad"]}[state]
            out.append(_box(x, y, cell - 4, 30, fill, letter, dashed=state == "draft", hatch=state == "stale"))
        if note:
            out.append(_text(left, y + 48, note, 11))
        return out

    body = [_text(left, 18, "block 0", 11), _text(left + 4 * cell + 8, 18, "block 1", 11),
            _text(left + 8 * cell + 16, 18, "block 2 (new in step 0)", 11)]
    body += row(28, "before step 0", tokens[:9] + ["D", "E", "F"], ["kv"] * 8 + ["none"] + ["draft"] * 3,
                "9 tokens, 8 with K/V; lookup drafts D E F (dashed): A B C began R0 too")
    body += row(98, "step 0 runs", tokens[:12], ["kv"] * 8 + ["new"] * 4,
                "1 + 3 positions, C and the drafts: K/V written (blue); the model says D, E, Z")
    body += row(168, "verified", tokens[:11] + ["Z"], ["kv"] * 11 + ["stale"],
                "D E kept, F replaced by Z: 12 tokens; num_computed_tokens rolled back to 11")
    body.append(_text(left, 232, "slot 11 still holds F's K/V (hatched); attention reads only the first 11", 11))
    body += row(250, "step 1", tokens[:11] + ["Z"], ["kv"] * 12,
                "Z's K/V overwrites slot 11, in the block R0 already holds")
    return _svg(720, 305, body, "Speculative decoding: a rejected draft rolled back")


FIGURES = {"lora_padded_batch.svg": lora_padded_batch, "spec_decode_rollback.svg": spec_decode_rollback}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = parser.parse_args()
    stale = []
    for name, draw in FIGURES.items():
        svg = draw()
        path = ASSETS / name
        if args.check:
            if not path.is_file() or path.read_text() != svg:
                stale.append(name)
        else:
            path.write_text(svg)
    if stale:
        print(f"stale: {stale}; run python scripts/course_figures.py")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
