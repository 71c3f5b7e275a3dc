"""``python -m stage5_server ...`` runs the ``stagedserve`` command (``stage5_server/cli/``).

vLLM: the ``vllm`` console script, ``vllm/entrypoints/cli/main.py``.
"""

import sys

from stage5_server.cli import main

sys.exit(main())
