"""Text in and out: transformers' tokenizer, the chat template (``shared/chat_template.py``),
incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from shared.chat_template import apply_chat_template


class Tokenizer:
    def __init__(self, path: str | Path):
        self.hf = AutoTokenizer.from_pretrained(str(path))
        # Detokenization runs for every request every step: when transformers' wrapper would
        # add nothing (a fast tokenizer, no space clean-up), call the Rust tokenizer directly.
        backend = getattr(self.hf, "backend_tokenizer", None)
        self._backend_decode = None if getattr(self.hf, "clean_up_tokenization_spaces", False) else \
            getattr(backend, "decode", None)
        # What ``decode(..., skip_special_tokens=True)`` leaves out: the special tokens and added tokens marked special.
        added = getattr(self.hf, "added_tokens_decoder", {})
        self.special_token_ids = frozenset(self.hf.all_special_ids) | {i for i, t in added.items() if t.special}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            chat_template_kwargs: dict | None = None,
                            control_tokens_in_messages: bool = False) -> list[int]:
        """The conversation's token ids. Control tokens come only from the template: a control-token
        string inside a message stays text (``shared/chat_template.py``), unless
        ``control_tokens_in_messages`` (for trusted callers)."""
        return apply_chat_template(self.hf, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                   chat_template=chat_template, template_kwargs=chat_template_kwargs,
                                   control_tokens_in_messages=control_tokens_in_messages)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)


class IncrementalDetokenizer:
    """Decodes output tokens as they arrive without ever emitting half a character.

    A multi-byte character (an emoji, a CJK ideograph) can span several byte-level
    tokens; decoding part of it yields U+FFFD. We decode a short window of recent tokens
    and hold text back until it no longer ends in U+FFFD (vLLM's ``detokenize_incrementally``).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # start of the window we re-decode for context
        self._read_offset = 0  # tokens before this are already in self.text

    def add_tokens(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.token_ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = decode(self.token_ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new_text = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += new_text
        return new_text
