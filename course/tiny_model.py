"""Tiny local checkpoints: random weights through transformers' own model classes.

Nothing can be downloaded in tests, so the parity tests and the benchmarks build small
checkpoints here: a byte-level BPE tokenizer trained offline on the text below, a chat
template, and random weights from ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` with a fixed seed, saved with ``save_pretrained`` (safetensors).
The default model and the other named ones are in ``shared.named_models``, which builds ``tiny`` and
``small`` here by name (``cached_tiny_model``): no stage imports this package.
The result is an ordinary Hugging Face model directory: transformers, this project and
peers such as vLLM all load it the same way. Head dim is 32 so vLLM's CPU build accepts it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from shared.cache import build_once, cache_dir

ARCHS = ("llama", "qwen2", "qwen3")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML. With ``tools``, a system turn lists them (as JSON, inside <tools></tools>); an assistant's
# tool calls are written as <tool_call>{"name": ..., "arguments": ...}</tool_call> and a tool's
# result as a "tool" turn inside <tool_response></tool_response> (the Hermes format that
# ``--tool-call-parser hermes`` reads back). A conversation without tools renders as plain ChatML.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system{{ '\\n' }}{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] }}{{ '\\n\\n' }}{% endif %}"
    "You can call these functions, described as JSON inside <tools></tools>:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "To call one, answer with <tool_call>{\"name\": <its name>, \"arguments\": <a JSON object>}</tool_call>."
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if not (tools and loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}{{ '\\n' }}"
    "{% if message['role'] == 'tool' %}<tool_response>{{ '\\n' }}{{ message['content'] }}{{ '\\n' }}</tool_response>"
    "{% else %}{{ message['content'] if message['content'] is not none else '' }}"
    "{% for call in message['tool_calls'] or [] %}{{ '\\n' }}<tool_call>{{ '\\n' }}"
    "{\"name\": {{ call['function']['name'] | tojson }}, \"arguments\": "
    "{{ call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson }}}{{ '\\n' }}</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Own text for the tokenizer to learn from, with some non-ASCII so multi-byte
# characters span several tokens (the incremental detokenizer must not split them).
CORPUS = """\
A serving engine turns prompts into tokens, schedules them, and streams text back.
Every request has a prompt and a growing list of generated tokens. The model reads the
whole prompt once, in prefill, and then produces one token per step, in decode.
Keys and values of earlier positions are kept in a cache so that decode does not redo
the prompt. The cache is the largest consumer of memory after the weights.
Reserving the longest possible sequence for every request wastes most of that memory.
Blocks of a few tokens, found through a table, waste at most one partial block.
A scheduler spends one token budget per step: running requests decode first, and what is
left goes to chunks of waiting prompts. Requests join and leave between steps.
When memory runs out, the newest request is preempted and recomputed later.
Prompts that start the same way share their cached blocks: a system prompt is computed
once and reused by every request that carries it.
The server speaks the OpenAI API, checks an API key on every route, and reports metrics.
Latency is measured as time to first token, inter-token latency and time per output token.
Goodput counts the requests that met their targets, divided by the length of the window.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096.
Hello, world! How are you today? I am fine, thank you. What is 2 + 3? It is 5.
Café, naïve, résumé, über, señor, façade. 東京 大阪 京都. Привет мир. Γειά σου κόσμε. 🙂 🚀 ✓
def add(a, b):
    return a + b
"""


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        model_max_length=1 << 30,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def transformers_config(arch: str, vocab_size: int, eos_ids: list[int], size: dict):
    """transformers' config and model class of a tiny ``arch`` model of ``size``."""
    import transformers

    common = dict(
        # A model's vocabulary may be larger than its tokenizer's (padded embeddings).
        vocab_size=max(vocab_size, size.get("vocab_size", 0)), hidden_size=size["hidden_size"],
        intermediate_size=size["intermediate_size"], num_hidden_layers=size["num_hidden_layers"],
        num_attention_heads=size["num_attention_heads"], num_key_value_heads=size["num_key_value_heads"],
        head_dim=size.get("head_dim", 32), max_position_embeddings=size.get("max_position_embeddings", 4096),
        rms_norm_eps=1e-6, rope_theta=10000.0, eos_token_id=eos_ids, bos_token_id=None, pad_token_id=eos_ids[0],
        # A wide init makes logits well separated, so greedy argmax never hinges on a
        # float rounding difference between two implementations.
        initializer_range=size.get("initializer_range", 0.25), tie_word_embeddings=arch == "qwen3",
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    if arch == "qwen2":
        return transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    return transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM


TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
SMALL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)
# Qwen3-0.6B's shapes, for timing on a GPU (random weights: the text is noise, the work is real).
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  initializer_range=0.02, dtype="bfloat16")
SIZES = {"tiny": TINY, "small": SMALL, "qwen3-0.6b": QWEN3_0_6B}


def make_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0, vocab_size: int = 512,
                    size: dict | None = None) -> Path:
    """Write a random-weight checkpoint of family ``arch`` to ``path`` and return it."""
    if arch not in ARCHS:
        raise ValueError(f"arch: unknown {arch!r}; choose one of {ARCHS}")
    import torch

    path = Path(path)
    tokenizer = train_tokenizer(vocab_size)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    config, model_cls = transformers_config(arch, len(tokenizer), eos_ids, size or TINY)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if "dtype" in (size or {}):
        model = model.to(getattr(torch, size["dtype"]))
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = eos_ids[0]
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cached_tiny_model(arch: str = "llama", seed: int = 0, size_name: str = "tiny",
                      make: Callable[..., Path] | None = None, chat_template: str = CHAT_TEMPLATE) -> Path:
    """Build (once, atomically, safe across processes) and return a cached checkpoint (``make``: how an
    ``arch`` this module does not know is made, with ``chat_template``)."""
    if size_name not in SIZES:
        raise ValueError(f"size: unknown {size_name!r}; choose one of {sorted(SIZES)}")
    target = cache_dir() / f"{arch}-{size_name}-seed{seed}-v1"
    if (target / "config.json").is_file():
        refresh_chat_template(target, chat_template)
    make = make or (lambda path, **kwargs: make_tiny_model(path, arch=arch, **kwargs))
    return build_once(target, lambda tmp: make(tmp, seed=seed, size=SIZES[size_name]))


def refresh_chat_template(checkpoint: Path, template: str) -> None:
    """The template learned to render tools after checkpoints were first cached; weights and
    tokenizer did not change, so an older cached checkpoint gets the new template in place."""
    path = checkpoint / "chat_template.jinja"
    if path.is_file() and path.read_text() != template:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(template)
        tmp.replace(path)
