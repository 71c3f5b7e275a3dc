"""``LLM.embed`` and ``LLM.score``: the offline API of a pooling model.

``embed`` tokenizes each prompt, checks its length against ``max_model_len`` (or truncates it to
``truncate_prompt_tokens``), adds one engine request per prompt (``InputProcessor.pooling_request``)
and steps the engine until every one has its vector (``LLM``'s own step loop). ``score`` embeds both
sides and returns their cosine similarity (an embedding model's score, as vLLM computes it for a
bi-encoder). A generating model refuses both; a pooling model refuses
``generate`` and ``chat``.

vLLM: ``LLM.embed``, ``LLM.encode`` and ``LLM.score`` in ``vllm/entrypoints/llm.py``; the cosine score in
``_cosine_similarity`` (``vllm/entrypoints/score_utils.py``).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

from shared.tokenizer import Tokenizer
from stage5_server.errors import ContextLengthExceeded
from stage5_server.pooling.outputs import EmbeddingOutput, EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput

NOT_POOLING = ("{api} is only supported for pooling models; this model generates. A checkpoint with an "
               "encoder architecture pools on its own; a decoder pools with runner='pooling' or convert='embed'.")
NOT_GENERATING = ("{api}: this model runs the pooling runner (it returns vectors, never tokens); "
                  "use LLM.embed or LLM.score")


def pooling_token_ids(prompt: str | list[int], tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                      truncate_prompt_tokens: int | None = None, param: str = "input",
                      keep_last: bool = False) -> list[int]:
    """A pooling prompt as checked token ids. Longer than ``max_model_len``: refused, unless
    ``truncate_prompt_tokens`` (-1: ``max_model_len``) keeps a text's first tokens (as the tokenizer truncates;
    ``keep_last``: its last ones, the special tokens around them kept) or a list of ids' last ones (as vLLM)."""
    limit = None
    if truncate_prompt_tokens is not None:
        limit = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= max_model_len:
            raise ValueError(f"truncate_prompt_tokens: must be -1 or in [1, max_model_len={max_model_len}], "
                             f"got {truncate_prompt_tokens!r}")
    if isinstance(prompt, str):
        if not prompt:  # OpenAI refuses it too; an encoder would embed its special tokens alone
            raise ValueError(f"{param}: empty input; at least one token is needed")
        if limit is None:
            token_ids = tokenizer.encode(prompt)
        elif keep_last:
            token_ids = _last_tokens(prompt, tokenizer, limit, param)
        else:
            token_ids = tokenizer.hf(prompt, truncation=True, max_length=limit)["input_ids"]
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        token_ids = list(prompt) if limit is None else list(prompt)[-limit:]  # vLLM keeps the last ids
    else:
        raise ValueError(f"{param}: expected text or a list of token ids, got {type(prompt).__name__}")
    if not token_ids:
        raise ValueError(f"{param}: empty input; at least one token is needed")
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"{param}: token ids must be in [0, {vocab_size})")
    if len(token_ids) > max_model_len:
        raise ContextLengthExceeded(param, f"This model's maximum context length is {max_model_len} tokens. "
                                    f"However, you requested {len(token_ids)} tokens in the input for embedding "
                                    "generation. Please reduce the length of the input.")
    return token_ids


def _last_tokens(text: str, tokenizer: Tokenizer, limit: int, param: str) -> list[int]:
    """``text``'s token ids cut to ``limit`` from the front: the special tokens the tokenizer adds around it stay."""
    full = tokenizer.encode(text)
    if len(full) <= limit:
        return full
    plain = tokenizer.encode(text, add_special_tokens=False)
    specials = len(full) - len(plain)
    head = next((h for h in range(specials + 1) if full[h:h + len(plain)] == plain), None)
    if head is None or limit <= specials:  # the text's tokens are not a run inside the full ids: cut plainly
        if limit <= specials:
            raise ValueError(f"{param}: a limit of {limit} tokens leaves no room for the text beside this model's "
                             f"{specials} special tokens")
        return full[-limit:]
    return full[:head] + plain[len(plain) - (limit - specials):] + full[head + len(plain):]


def cosine_scores(left: list[list[float]], right: list[list[float]]) -> list[float]:
    """Pairwise cosine similarity of ``left[i]`` and ``right[i]``."""
    a, b = torch.tensor(left, dtype=torch.float32), torch.tensor(right, dtype=torch.float32)
    return F.cosine_similarity(a, b, dim=-1).tolist()


def pair_up(text_1: Any, text_2: Any, names: tuple[str, str] = ("text_1", "text_2")) -> tuple[list, list]:
    """vLLM's pairing: one against one, one against many, or many against as many. Returns both sides as lists,
    the first one not repeated (one text scores against each of the second). A ValueError starts with the
    field it blames (``names``: the fields the two sides came from)."""
    for name, given in zip(names, (text_1, text_2)):
        if isinstance(given, list) and not given:
            raise ValueError(f"{name}: an empty list; give a text or a list of texts")
    first = text_1 if isinstance(text_1, list) and text_1 and not isinstance(text_1[0], int) else [text_1]
    second = text_2 if isinstance(text_2, list) and text_2 and not isinstance(text_2[0], int) else [text_2]
    if len(first) not in (1, len(second)):
        raise ValueError(f"{names[0]}: {len(first)} inputs cannot pair with {names[1]}'s {len(second)}; give one, "
                         f"or as many as {names[1]}")
    return first, second


class PoolingAPI:
    """Mixed into stage 5's ``LLM`` (``llm.py``)."""

    _pool_ids = itertools.count()

    def embed(self, prompts: str | list[int] | list, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (text or token ids), in order."""
        self._require_pooling("LLM.embed()")
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        prompt_list = [prompts] if single else list(prompts)
        vocab_size, max_len = self.model_config.vocab_size, self.max_model_len
        all_ids = [pooling_token_ids(p, self.tokenizer, vocab_size, max_len, truncate_prompt_tokens, "prompts")
                   for p in prompt_list]  # every prompt checked before any runs
        requests = [self.input_processor.pooling_request(f"pool-{next(self._pool_ids)}", ids) for ids in all_ids]
        outputs = self._run(all_ids, [(r.request_id, None, [self.engine.preprocess_add_request(r)]) for r in requests],
                            use_tqdm)
        for output in outputs:
            if output.pooled is None:
                raise RuntimeError(f"request {output.request_id} ended without a vector")
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.pooled)) for o in outputs]

    def score(self, text_1: str | list, text_2: str | list,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """The cosine similarity of each pair (``pair_up``) of embeddings."""
        self._require_pooling("LLM.score()")
        first, second = pair_up(text_1, text_2)
        first = first * len(second) if len(first) == 1 else first
        unique = list(dict.fromkeys(map(_key, first + second)))
        embedded = self.embed([_prompt(k) for k in unique], truncate_prompt_tokens)
        by_key = {k: out for k, out in zip(unique, embedded)}
        scores = cosine_scores([by_key[_key(a)].outputs.embedding for a in first],
                               [by_key[_key(b)].outputs.embedding for b in second])
        return [ScoringRequestOutput(f"score-{i}", by_key[_key(a)].prompt_token_ids + by_key[_key(b)].prompt_token_ids,
                                     ScoringOutput(s)) for i, (a, b, s) in enumerate(zip(first, second, scores))]

    def _require_pooling(self, api: str) -> None:
        if self.config.runner != "pooling":
            raise ValueError(NOT_POOLING.format(api=api))


def _key(prompt: str | list[int]) -> str | tuple[int, ...]:
    return prompt if isinstance(prompt, str) else tuple(prompt)


def _prompt(key: str | tuple[int, ...]) -> str | list[int]:
    return key if isinstance(key, str) else list(key)
