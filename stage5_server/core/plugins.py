"""Engine-core plugins: code an operator asks every engine-core process to run once its core is built.

``STAGEDSERVE_ENGINE_PLUGINS="package.module:function,..."`` names them; each is called with the
process's ``EngineCore`` (to instrument a step, or inject a fault, as the reliability tests do). One
that fails to load fails the start-up. Unset, nothing is loaded.

vLLM: ``load_general_plugins`` in ``vllm/plugins/__init__.py``.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any

logger = logging.getLogger("stagedserve")

PLUGINS_ENV = "STAGEDSERVE_ENGINE_PLUGINS"


def load_engine_plugins(core: Any) -> list[str]:
    """Call every plugin of ``$STAGEDSERVE_ENGINE_PLUGINS`` with the engine ``core``; their names."""
    names = [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]
    for name in names:
        module_name, sep, function_name = name.partition(":")
        if not sep or not module_name or not function_name:
            raise ValueError(f"{PLUGINS_ENV}: expected module:function, got {name!r}")
        getattr(importlib.import_module(module_name), function_name)(core)
        logger.info("engine plugin %s loaded", name)
    return names
