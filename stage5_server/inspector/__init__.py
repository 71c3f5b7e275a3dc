"""The inspector: watch the engine work, step by step, live on a server or replayed from a file.

Each engine step becomes a ``StepRecord`` (``records.py``): the tokens of every scheduled request by kind
(prefill chunk, decode, speculative verify) against the token budget, the KV blocks each one was given,
reused from the prefix cache, lost to eviction or gave back, preemptions, the queues, the offload tier's
copies and the drafts. The pieces:

- ``observer.py``: what the engine core holds as its ``inspector`` member when ``enable_inspector`` is on
  (``stagedserve serve --enable-inspector``), called twice a step; off, no record is built;
- ``tracker.py``: the KV cache manager's block tables, step after step, turned into block events;
- ``buffer.py``: the bounded buffers between the engine, the API server and each page: the oldest record
  goes first, and the reader is told how many it missed;
- ``hub.py`` and ``routes.py``: on the server, ``GET /inspect`` (the page), ``/inspect/events`` (a
  server-sent stream of records) behind the API key, each trust group seeing its own requests' ids and
  text and everyone else's only as anonymous bars and blocks;
- ``recorders.py``: ``record(llm, prompts)`` records a run of any stage into a ``Trace`` file;
- ``static/``: the page (plain JavaScript and SVG, no library), which also replays traces in the course.

vLLM: none; its users watch Prometheus metrics (``vllm/v1/metrics/``). llama.cpp's server has a chat page.
"""

# Loaded on first use (``__getattr__`` below): the engine core's messages name ``records.StepRecords``, and importing
# that must not load the observer, the recorders or the server's side of a room that is off.
_EXPORTS = {"RecordBuffer": "buffer", "StepObserver": "observer", "StaticBatchRecorder": "recorders",
            "dry_run": "recorders", "record": "recorders", "FreedBlocks": "records", "RequestStep": "records",
            "StepRecord": "records", "StepRecords": "records", "Trace": "records", "TraceRequest": "records"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
