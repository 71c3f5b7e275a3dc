"""The duck-typed request the prefix-cache manager reads, without the rest of an engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    num_prompt_tokens: int = -1

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)
