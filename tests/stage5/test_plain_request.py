"""A plain request enters no feature room: on a server started without LoRA, images, speculative decoding,
pooling, a KV connector or weight sync, a streaming text chat request (sent by the openai client, through the
real app, engine thread and workers) calls no function of those rooms, nor of the server's own modules for
adapters and fetched images. Every thread is traced with a profile function (``threading.setprofile``, set
before the engine and the server start); the window is one request after a warm-up."""

from __future__ import annotations

import sys
import threading
import time

from openai import OpenAI

from stage5_server.engine.thread_client import AsyncLLM
from stage5_server.server import create_app
from tests.stage5.server_fixtures import REPO, make_llm, running_server

KEY = "plain-key"
FEATURE_ROOMS = ("lora", "multimodal", "spec_decode", "pooling", "kv_transfer", "weight_sync")
FEATURE_FILES = ("server/lora_models.py", "server/media.py", "server/pooling.py")  # the features' HTTP sides


class CallRecorder:
    """The file of every Python function called (or resumed) on any thread while ``recording``."""

    def __init__(self):
        self.recording = False
        self.files: set[str] = set()

    def profile(self, frame, event: str, arg) -> None:
        if self.recording and event == "call":
            self.files.add(frame.f_code.co_filename)


def feature_code(files: set[str]) -> list[str]:
    stage5 = REPO / "stage5_server"
    prefixes = tuple(str(stage5 / room) + "/" for room in FEATURE_ROOMS)
    exact = {str(stage5 / f) for f in FEATURE_FILES}
    return sorted(f for f in files if f.startswith(prefixes) or f in exact)


def stream_chat(client: OpenAI, content: str) -> str:
    stream = client.chat.completions.create(model="plain", messages=[{"role": "user", "content": content}],
                                            max_tokens=8, temperature=0, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_a_streaming_chat_request_without_features_calls_no_feature_code(tiny_llama):
    recorder = CallRecorder()
    threading.setprofile(recorder.profile)  # every thread started from here: the engine's, uvicorn's, the executor's
    try:
        engine = AsyncLLM.from_llm(make_llm(tiny_llama), log_stats_interval=None)
        try:
            app = create_app(engine, api_keys=[KEY], served_model_name="plain", log_stats_interval=None)
            with running_server(app) as server:
                client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
                stream_chat(client, "Say hello.")  # warm-up: whatever runs once is done
                time.sleep(0.2)
                sys.setprofile(recorder.profile)
                recorder.recording = True
                text = stream_chat(client, "Name three colours.")
                time.sleep(0.2)  # the engine's clean-up of the finished request falls inside
                recorder.recording = False
        finally:
            engine.shutdown()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert text  # it streamed
    assert any("/stage5_server/core/" in f for f in recorder.files)  # the trace saw the engine work
    assert feature_code(recorder.files) == []
