"""Each serving process names itself (``ss-api-0``, ``ss-engine-1``, ``ss-coordinator``, ``ss-tp-0``, ...), so
``ps``, ``top`` and psutil show the topology by role. A leaf module: the tensor-parallel workers use it too."""

from __future__ import annotations

import ctypes


def set_process_name(name: str) -> None:
    """This process's ``comm`` (15 characters; Linux only, a no-op elsewhere)."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
