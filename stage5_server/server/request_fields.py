"""Top-level request fields a route's request model does not define: ignored, as vLLM ignores them, or refused.

vLLM's request models accept any extra field and log it (``OpenAIBaseModel`` in
``vllm/entrypoints/openai/engine/protocol.py``: ``extra="allow"`` and a validator that logs "The
following fields were present in the request but ignored"), so a client that sends its own extras
(``extra_body``) to several servers works against vLLM. Here, on the routes vLLM serves
(``VLLM_FIELDS``), before the request model validates the body (``body.py``):

    a field the route defines                      -> validated as usual
    one of vLLM's fields that this server lacks    -> accepted when its value is one that changes
                                                      nothing here (vLLM's default; logged once), else
                                                      a 400 naming it: ignoring it would change the answer
    any other field                                -> dropped, named in the log and in the response's
                                                      ``X-Stagedserve-Ignored-Fields`` header

``--strict-request-fields`` (``ServerConfig.strict_request_fields``) keeps every undefined field a 400,
as OpenAI's own API answers. Only the top level is lenient: a field inside an object (a message, a tool,
``stream_options``) is still a 400, and so is any field on the operator's routes (LoRA adapters, the
development routes). The serving page gives the reasons.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

from pydantic import BaseModel

from stage5_server.server.errors import APIError
from stage5_server.server.protocol import is_noop, log_ignored

logger = logging.getLogger("stagedserve")

IGNORED_FIELDS_HEADER = b"x-stagedserve-ignored-fields"
IGNORED_SCOPE_KEY = "stagedserve.ignored_fields"  # the names dropped from this request's body
MAX_NAMES_SHOWN, MAX_NAME_CHARS = 32, 64  # a header and a log line stay short, whatever the body holds

# vLLM's fields (its request models, vLLM 0.32) that the route's model here does not define, each with the
# values that change nothing here (null always does); any other value is a 400.
_GENERATION = {"use_beam_search": (False,), "length_penalty": (1.0,), "skip_special_tokens": (True,),
               "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (), "allowed_token_ids": (),
               "bad_words": ([],), "prompt_logprobs": (), "logits_processors": (), "priority": (0,),
               "request_id": (), "return_tokens_as_token_ids": (False,), "return_token_ids": (False,),
               "kv_transfer_params": (), "vllm_xargs": ()}
# Removed from vLLM's requests (vLLM now ignores them, unconstrained, with a warning): here a 400 says what to send.
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_json_object",
          "guided_decoding_backend", "guided_whitespace_pattern")
_CHAT = {**_GENERATION, **dict.fromkeys(GUIDED, ()), "echo": (False,), "add_generation_prompt": (True,),
         "continue_final_message": (False,), "add_special_tokens": (False,), "documents": (),
         "logprob_token_ids": (), "truncation_side": (), "session_id": (), "return_prompt_text": (False,),
         "thinking_token_budget": (), "include_reasoning": (True,), "ec_transfer_params": (),
         "repetition_detection": (), "stream_interval": (), "watermarking": (False,)}
_COMPLETION = {**_GENERATION, **dict.fromkeys(GUIDED, ()), "add_special_tokens": (True,), "prompt_embeds": ()}
_RESPONSES = {"skip_special_tokens": (True,), "request_id": (), "priority": (0,), "background": (False,),
              "max_tool_calls": (), "prompt": (), "enable_response_messages": (False,), "previous_input_messages": ()}
_NATIVE_ORDER = ("little", "native") if sys.byteorder == "little" else ("little",)
_POOLING_BASE = {"priority": (0,), "request_id": (), "cache_salt": (), "mm_processor_kwargs": (),
                 "padding": ("do_not_pad",), "truncation_side": ("right",), "use_activation": (True,),
                 "normalize": ()}
_EMBED = {**_POOLING_BASE, "embed_dtype": ("float32",), "endianness": _NATIVE_ORDER, "add_special_tokens": (True,),
          "messages": (), "chat_template": (), "chat_template_kwargs": (), "add_generation_prompt": (False,),
          "continue_final_message": (False,), "media_io_kwargs": ()}
_SCORE = {**_POOLING_BASE, "max_tokens_per_query": (0,), "max_tokens_per_doc": (0,)}
_TOKENIZE = {"return_token_strs": (False,), "continue_final_message": (False,), "chat_template": (),
             "chat_template_kwargs": (), "mm_processor_kwargs": (), "media_io_kwargs": ()}
VLLM_FIELDS: dict[str, dict[str, tuple]] = {
    "/v1/completions": _COMPLETION, "/v1/chat/completions": _CHAT, "/v1/responses": _RESPONSES,
    "/v1/embeddings": _EMBED, "/pooling": {**_EMBED, "task": ("embed",)}, "/v2/embed": {},
    "/v1/score": _SCORE, "/score": _SCORE, "/v1/rerank": _SCORE, "/rerank": _SCORE, "/v2/rerank": _SCORE,
    "/tokenize": _TOKENIZE, "/detokenize": {},
}
LENIENT_ROUTES = frozenset(VLLM_FIELDS)


def field_names(model: Any) -> frozenset[str] | None:
    """The top-level names (and aliases) a request model defines; None for a route whose body is no model."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    names = set()
    for name, field in model.model_fields.items():
        names.add(name)
        if field.alias:
            names.add(field.alias)
    return frozenset(names)


def sort_fields(path: str, body: Any, known: frozenset[str], strict: bool) -> list[str]:
    """Drop from ``body`` (in place) what route ``path``'s model does not define, as the module docstring says;
    the names of the dropped fields that mean nothing here. ``strict``: drop nothing (the model refuses them)."""
    vllm = VLLM_FIELDS.get(path)
    if vllm is None or not isinstance(body, dict):
        return []
    ignored = []
    for name in [n for n in body if n not in known]:
        if name in vllm:
            if not is_noop(body[name], vllm[name]):
                raise APIError(400, _refusal(name, vllm[name]), param=name)
            if not strict:
                del body[name]
                log_ignored(name)
        elif not strict:
            del body[name]
            ignored.append(name)
    return ignored


def _refusal(name: str, allowed: tuple) -> str:
    if name in GUIDED:
        return f"{name}: vLLM removed this field; send structured_outputs (or response_format) instead"
    values = "".join(f"{json.dumps(a)} or " for a in allowed)
    return f"{name}: vLLM's field is not supported by this server (only {values}null)"


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def shown_names(names: list[str]) -> str:
    """``names`` for a header or a log line: plain names as they are, any other name JSON-quoted (ASCII, no
    line breaks) and cut short; at most ``MAX_NAMES_SHOWN`` of them."""
    shown = [n if _PLAIN_NAME.fullmatch(n) else json.dumps(n[:MAX_NAME_CHARS]) for n in names[:MAX_NAMES_SHOWN]]
    more = f", and {len(names) - MAX_NAMES_SHOWN} more" if len(names) > MAX_NAMES_SHOWN else ""
    return ", ".join(shown) + more


def note_ignored(path: str, names: list[str]) -> None:
    logger.info("%s: request fields ignored (this server and vLLM define none of them): %s", path,
                shown_names(names))
