"""tiny-chat, the small trained model, answers: held-out accuracy through every stage's ``LLM``, and
the same tokens as transformers' own ``generate`` on this trained checkpoint."""

from __future__ import annotations

import functools

import pytest

from course import chat_tasks
from shared import SamplingParams, tiny_chat_model

PER_TASK = 60  # distinct held-out questions per task (square: its 32-entry table)
MIN_ACCURACY = 0.95
GREEDY = SamplingParams(temperature=0, max_tokens=16)


@functools.cache
def held_out() -> list[chat_tasks.Example]:
    return [ex for exs in chat_tasks.held_out_set(PER_TASK).values() for ex in exs]


@functools.cache
def hf_replies(model_path: str, max_new_tokens: int) -> tuple[tuple[int, ...], ...]:
    """Token ids from transformers' ``generate`` (greedy, float32, one prompt at a time, stops at EOS)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = set(model.generation_config.eos_token_id)
    results = []
    for ex in held_out()[::4]:
        ids = tokenizer.apply_chat_template(ex.messages(), add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False)[0, ids.shape[1]:].tolist()
        # transformers pads finished rows; keep the tokens up to and including the first EOS.
        stop = next((i for i, t in enumerate(out) if t in eos), len(out) - 1)
        results.append(tuple(out[:stop + 1]))
    return tuple(results)


@pytest.mark.slow
def test_held_out_accuracy_at_least_95_percent_per_task(stage):
    llm = stage.make_llm(tiny_chat_model(), max_model_len=320, max_num_seqs=32)
    questions = held_out()
    outputs = llm.chat([ex.messages() for ex in questions], GREEDY, use_tqdm=False)
    replies = [out.outputs[0].text for out in outputs]
    scores = chat_tasks.accuracy(list(zip(questions, replies)))
    assert set(scores) == set(chat_tasks.TASKS)
    wrong = [(ex.user, ex.answer, text) for ex, text in zip(questions, replies) if not chat_tasks.is_correct(ex, text)]
    assert all(score >= MIN_ACCURACY for score in scores.values()), (scores, wrong[:10])
    # The model stops by itself after the answer.
    assert sum(out.outputs[0].finish_reason == "stop" for out in outputs) >= MIN_ACCURACY * len(outputs)


@pytest.mark.slow
def test_same_tokens_as_transformers_generate_on_the_trained_model(stage):
    expected = hf_replies(tiny_chat_model(), GREEDY.max_tokens)
    llm = stage.make_llm(tiny_chat_model(), max_model_len=320, max_num_seqs=32)
    questions = held_out()[::4]
    outputs = llm.chat([ex.messages() for ex in questions], GREEDY, use_tqdm=False)
    assert len(expected) == len(questions) > 60
    for ex, out, want in zip(questions, outputs, expected):
        assert tuple(out.outputs[0].token_ids) == want, ex.user
