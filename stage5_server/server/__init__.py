"""The secured OpenAI-compatible HTTP server over an ``AsyncEngine``.

One module a concern: ``app.py`` (the app factory), ``config.py`` (``ServerConfig``, the server's
options), ``auth.py`` (API keys, trust groups and their cache salts), ``limits.py`` (body size),
``errors.py`` (the one error mapping), ``protocol.py`` and ``tool_protocol.py`` (the request
models), ``serving.py`` (what every generation endpoint does), ``completions.py``, ``chat.py`` and
``models.py`` (the routes), ``sse.py`` (streaming), ``metrics.py`` (Prometheus), ``openapi.py``
(the schema), ``harness.py`` (uvicorn on a thread).

vLLM: ``vllm/entrypoints/openai/``.
"""

from stage5_server.server.app import create_app
from stage5_server.server.config import ServerConfig
from stage5_server.server.harness import ServerThread

__all__ = ["ServerConfig", "ServerThread", "create_app"]
