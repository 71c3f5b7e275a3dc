"""The server on tiny-chat (the small trained model) gives right answers: held-out questions of every
task through the official ``openai`` client, concurrently, at least 95% exact per task."""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI

from course import chat_tasks
from shared import tiny_chat_model
from stage5_server.server import create_app
from tests.stage5.server_fixtures import make_llm, running_server

KEY = "test-key-default-model"
MODEL = "tiny-chat"
PER_TASK = 60
MIN_ACCURACY = 0.95


async def ask_all(url: str, questions: list[chat_tasks.Example]):
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        limit = asyncio.Semaphore(16)

        async def ask(ex: chat_tasks.Example):
            async with limit:
                return await client.chat.completions.create(model=MODEL, messages=ex.messages(), max_tokens=16,
                                                            temperature=0.0)

        return await asyncio.gather(*[ask(ex) for ex in questions])


@pytest.mark.slow
def test_served_tiny_chat_answers_held_out_questions():
    questions = [ex for exs in chat_tasks.held_out_set(PER_TASK).values() for ex in exs]
    llm = make_llm(tiny_chat_model(), max_model_len=320)
    app = create_app(llm, api_keys=[KEY], served_model_name=MODEL, log_stats_interval=None)
    with running_server(app) as server:
        responses = asyncio.run(ask_all(server.url, questions))
    replies = [r.choices[0].message.content for r in responses]
    scores = chat_tasks.accuracy(list(zip(questions, replies)))
    wrong = [(ex.user, ex.answer, text) for ex, text in zip(questions, replies) if not chat_tasks.is_correct(ex, text)]
    assert set(scores) == set(chat_tasks.TASKS)
    assert all(score >= MIN_ACCURACY for score in scores.values()), (scores, wrong[:10])
    assert sum(r.choices[0].finish_reason == "stop" for r in responses) >= MIN_ACCURACY * len(responses)
    # The shared system prompt of the "say" questions is served from the prefix cache after the first.
    cached = [r.usage.prompt_tokens_details.cached_tokens for r, ex in zip(responses, questions)
              if ex.task == "say" and r.usage.prompt_tokens_details]
    assert cached and max(cached) >= 16 * 10
