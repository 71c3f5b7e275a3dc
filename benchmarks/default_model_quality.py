"""How often the default model answers a fixed question set right (greedy), per category.

The questions (``benchmarks/data/default_model_questions.json``) are short facts, arithmetic,
instructions and multi-turn follow-ups, each with the words a right reply contains (matched as
whole words, case-insensitive unless the question says otherwise) and, for yes/no questions,
the word it must not contain. Every reply is written out next to its verdict, so the page shows
what the model gets wrong, not only how often.

    python -m benchmarks.default_model_quality [--model default --max-tokens 48]
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from shared import SamplingParams, resolve_model

QUESTIONS = Path(__file__).resolve().parent / "data" / "default_model_questions.json"


def _has_word(text: str, word: str, case_sensitive: bool) -> bool:
    pattern = r"(?<!\w)" + re.escape(word) + r"(?!\w)"
    return re.search(pattern, text, 0 if case_sensitive else re.IGNORECASE) is not None


def is_right(question: dict, reply: str) -> bool:
    case = question.get("case_sensitive", False)
    return any(_has_word(reply, a, case) for a in question["answers"]) and \
        not any(_has_word(reply, w, case) for w in question.get("not", []))


def evaluate(model: str, questions: list[dict], max_tokens: int) -> list[dict]:
    from stage5_server import LLM

    llm = LLM(model=model, device="cpu", max_model_len=512, max_num_seqs=len(questions))
    outputs = llm.chat([q["messages"] for q in questions], SamplingParams(temperature=0, max_tokens=max_tokens),
                       use_tqdm=False)
    rows = []
    for q, out in zip(questions, outputs):
        reply = out.outputs[0].text
        rows.append({"category": q["category"], "question": q["messages"][-1]["content"],
                     "turns": (len(q["messages"]) + 1) // 2, "answers": q["answers"], "reply": reply,
                     "right": is_right(q, reply), "finish_reason": out.outputs[0].finish_reason})
    return rows


def to_markdown(result: dict) -> str:
    rows, cfg = result["rows"], result["config"]
    lines = [
        "### Default model: answers to a fixed question set",
        "",
        provenance(result) + f"; model `{cfg['model']}`, greedy, at most {cfg['max_tokens']} tokens a reply. "
        "Right: the reply contains an expected word.",
        "",
        "| category | right | of |",
        "|---|---:|---:|",
    ]
    for category in dict.fromkeys(r["category"] for r in rows):
        mine = [r for r in rows if r["category"] == category]
        lines.append(f"| {category} | {sum(r['right'] for r in mine)} | {len(mine)} |")
    lines += [f"| **all** | **{sum(r['right'] for r in rows)}** | **{len(rows)}** |", "",
              "| | question (last turn) | reply |", "|---|---|---|"]
    for r in rows:
        reply = r["reply"].replace("\n", " ").replace("|", "\\|").strip()
        turns = f" ({r['turns']} turns)" if r["turns"] > 1 else ""
        lines.append(f"| {'right' if r['right'] else '**wrong**'} | {r['question']}{turns} | {reply} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "default_model_quality")
    ap.add_argument("--model", default="default", help="a name (default, tiny-chat), a directory or a .gguf file")
    ap.add_argument("--questions", default=str(QUESTIONS))
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    questions = json.loads(Path(args.questions).read_text())["questions"]
    start = time.perf_counter()
    rows = evaluate(resolve_model(args.model), questions, args.max_tokens)
    result = {**run_info("benchmarks.default_model_quality", argv), "runtime_s": time.perf_counter() - start,
              "config": {"model": args.model, "max_tokens": args.max_tokens, "questions": len(rows)},
              "right": sum(r["right"] for r in rows), "rows": rows}
    write_results("default_model_quality", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
