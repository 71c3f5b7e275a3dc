"""Stage 5: the deployable server (being assembled)."""

from stage5_server.llm import LLM

__all__ = ["LLM"]
