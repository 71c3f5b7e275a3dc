"""Checkable chat tasks for tiny-chat, the small trained model: generators and exact-answer checks.

Five tasks, each a user message with one right answer as an exact string:

- ``add``: "Add 4 and 5." -> "9" (both numbers 0-99);
- ``square``: "What is 7 squared?" -> "49" (0-31: a table to recall, like a times table);
- ``count``: "Count the words: cat dog sun" -> "3" (1-9 words);
- ``reverse``: "Reverse: cat dog sun" -> "sun dog cat" (2-5 words);
- ``say``: after the long shared ``SYSTEM_PROMPT``, "Say: cat dog" -> "cat dog" (1-3 words).

``add``, ``count``, ``reverse`` and ``say`` have far more questions than training sees, so
each question is assigned once and for all to the training or the held-out split by a hash
of its text: training never sees a held-out question, whatever the seed or the number of
examples. ``square`` has only 32 questions, so its held-out set is the table itself, asked
in fresh contexts; it measures recall, not generalization.

Pure Python and deterministic by seed: the training script, the tests and the docs all
draw from here. vLLM has no counterpart (it serves models; it does not train them).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

TASKS = ("add", "square", "count", "reverse", "say")
WORDS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "cup", "hat", "box",
         "car", "pen", "map", "key", "egg", "ice", "owl", "pig", "ant", "bee", "cow", "fox", "hen", "bus",
         "rain", "star", "ship")
MAX_SQUARE = 31
# Shared by many requests, long enough (195 tokens with the default model's tokenizer) that the prefix cache
# has full blocks to reuse.
SYSTEM_PROMPT = (
    "You are a careful reasoning assistant inside a small serving engine built for a course. "
    "A program checks every answer character by character, so answers are short and exact. "
    "To add two numbers, reply with their sum. For the square of a number, reply with the number "
    "times itself. To count words, reply with how many there are. To reverse words, reply with "
    "them in the opposite order. To say something, repeat the words after the colon. "
    "Never explain and never add punctuation. Many requests begin with these same instructions, "
    "so the engine computes them once and reuses them from its prefix cache."
)
# Fraction of non-``say`` questions asked after SYSTEM_PROMPT (``say`` always has it).
SYSTEM_PROMPT_FRACTION = 0.1
TRAIN_SEED, HELD_OUT_SEED = 0, 1_000_003


@dataclass(frozen=True)
class Example:
    task: str
    user: str
    answer: str
    system: str | None = None

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": "user", "content": self.user}]


def is_held_out(user: str) -> bool:
    """Whether a question belongs to the held-out split (one in eight, by a hash of its text)."""
    return zlib.crc32(user.encode()) % 8 == 0


def _words(rng: random.Random, low: int, high: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(low, high))]


def _draw(task: str, rng: random.Random) -> tuple[str, str]:
    if task == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"Add {a} and {b}.", str(a + b)
    if task == "square":
        n = rng.randint(0, MAX_SQUARE)
        return f"What is {n} squared?", str(n * n)
    if task == "count":
        words = _words(rng, 1, 9)
        return f"Count the words: {' '.join(words)}", str(len(words))
    if task == "reverse":
        words = _words(rng, 2, 5)
        return f"Reverse: {' '.join(words)}", " ".join(reversed(words))
    if task == "say":
        words = " ".join(_words(rng, 1, 3))
        return f"Say: {words}", words
    raise ValueError(f"task: unknown {task!r}; choose one of {TASKS}")


def make_example(task: str, rng: random.Random, held_out: bool) -> Example:
    """One question of ``task`` from the chosen split (``square`` has one split: its whole table)."""
    while True:
        user, answer = _draw(task, rng)
        if task == "square" or is_held_out(user) == held_out:
            break
    with_system = task == "say" or rng.random() < SYSTEM_PROMPT_FRACTION
    return Example(task, user, answer, SYSTEM_PROMPT if with_system else None)


def examples(task: str, count: int, seed: int, held_out: bool) -> list[Example]:
    """``count`` questions of ``task``, deterministic in ``seed``."""
    rng = random.Random(f"{task}:{seed}:{held_out}")
    return [make_example(task, rng, held_out) for _ in range(count)]


def held_out_set(per_task: int, seed: int = HELD_OUT_SEED) -> dict[str, list[Example]]:
    """Distinct held-out questions per task (square: its whole table, each in a random context)."""
    result = {}
    for task in TASKS:
        if task == "square":
            rng = random.Random(f"square:{seed}")
            result[task] = [Example("square", f"What is {n} squared?", str(n * n),
                                    SYSTEM_PROMPT if rng.random() < 0.5 else None)
                            for n in range(MAX_SQUARE + 1)]
            continue
        rng = random.Random(f"{task}:{seed}:True")
        seen: dict[str, Example] = {}
        while len(seen) < per_task:
            example = make_example(task, rng, held_out=True)
            seen.setdefault(example.user, example)
        result[task] = list(seen.values())
    return result


def is_correct(example: Example, text: str) -> bool:
    """Exact-answer check: the reply is the answer, character for character."""
    return text == example.answer


def accuracy(examples_and_replies: list[tuple[Example, str]]) -> dict[str, float]:
    """Fraction of exact answers per task."""
    totals: dict[str, list[int]] = {}
    for example, text in examples_and_replies:
        right_total = totals.setdefault(example.task, [0, 0])
        right_total[0] += is_correct(example, text)
        right_total[1] += 1
    return {task: right / total for task, (right, total) in totals.items()}
