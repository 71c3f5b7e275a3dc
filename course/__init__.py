"""The course's material around the engines: what tests, benchmarks, scripts and notebooks use, and no
stage imports.

- ``tiny_model.py``: tiny random checkpoints built on this machine (Llama, Qwen2, Qwen3), with a
  trained tokenizer and a chat template; ``tiny_llava.py``: a tiny LLaVA over them;
- ``chat_tasks.py``: the checkable tasks ``tiny-chat`` was trained on, and their scoring;
- ``workloads.py``: the request mixes the benchmarks and ``stagedserve bench serve`` send.

The named models ``tiny`` and ``small`` are built here on first use: ``shared.named_models`` names the
builder by its qualified name, so the engines load it only when one of those names is asked for.
"""

from course.tiny_model import cached_tiny_model, make_tiny_model

__all__ = ["cached_tiny_model", "make_tiny_model"]
