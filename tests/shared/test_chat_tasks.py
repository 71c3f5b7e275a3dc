"""The default model's tasks: deterministic by seed, right answers, held-out split disjoint from training."""

from __future__ import annotations

import pytest

from course import chat_tasks
from course.chat_tasks import Example


def test_examples_are_deterministic_in_the_seed():
    assert chat_tasks.examples("add", 50, seed=3, held_out=False) == chat_tasks.examples("add", 50, seed=3,
                                                                                         held_out=False)
    assert chat_tasks.examples("add", 50, seed=3, held_out=False) != chat_tasks.examples("add", 50, seed=4,
                                                                                         held_out=False)


@pytest.mark.parametrize("task", chat_tasks.TASKS)
def test_answers_are_right(task):
    for ex in chat_tasks.examples(task, 200, seed=0, held_out=False):
        body = ex.user.split(":", 1)[-1].split()
        if task == "add":
            a, b = (int(w.rstrip(".")) for w in ex.user.split() if w.rstrip(".").isdigit())
            assert ex.answer == str(a + b)
        elif task == "square":
            n = int(ex.user.split()[2])
            assert ex.answer == str(n * n) and 0 <= n <= chat_tasks.MAX_SQUARE
        elif task == "count":
            assert ex.answer == str(len(body)) and 1 <= len(body) <= 9
        elif task == "reverse":
            assert ex.answer.split() == body[::-1]
        else:
            assert ex.answer == " ".join(body) and ex.system == chat_tasks.SYSTEM_PROMPT


def test_held_out_questions_never_appear_in_training():
    held_out = chat_tasks.held_out_set(100)
    for task in ("add", "count", "reverse", "say"):
        questions = {ex.user for ex in held_out[task]}
        assert len(questions) == 100
        training = {ex.user for ex in chat_tasks.examples(task, 5_000, seed=chat_tasks.TRAIN_SEED, held_out=False)}
        assert not questions & training, task
        assert all(chat_tasks.is_held_out(q) for q in questions)
        assert not any(chat_tasks.is_held_out(q) for q in training)
    # The square table is small enough to learn whole: its held-out set is the table itself.
    assert [ex.answer for ex in held_out["square"]] == [str(n * n) for n in range(chat_tasks.MAX_SQUARE + 1)]


def test_some_questions_carry_the_shared_system_prompt():
    held_out = chat_tasks.held_out_set(100)
    for task, exs in held_out.items():
        with_system = sum(ex.system == chat_tasks.SYSTEM_PROMPT for ex in exs)
        assert (with_system == len(exs)) if task == "say" else (0 < with_system < len(exs)), task
    assert held_out["say"][0].messages()[0] == {"role": "system", "content": chat_tasks.SYSTEM_PROMPT}


def test_exact_answer_check_and_accuracy():
    ex = Example("add", "Add 4 and 5.", "9")
    assert chat_tasks.is_correct(ex, "9")
    assert not chat_tasks.is_correct(ex, "9 ") and not chat_tasks.is_correct(ex, "19")
    other = Example("count", "Count the words: cat", "1")
    assert chat_tasks.accuracy([(ex, "9"), (ex, "8"), (other, "1")]) == {"add": 0.5, "count": 1.0}


def test_unknown_task_is_a_value_error():
    with pytest.raises(ValueError, match="task"):
        chat_tasks.examples("divide", 1, seed=0, held_out=False)
