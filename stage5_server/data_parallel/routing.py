"""Which data-parallel rank gets a request: the least loaded one, or the one that holds its prefix.

A rank's load is the larger of the coordinator's newest waiting + running count and A times this
API server's own in-flight count there (vLLM's estimate), so a burst spreads between publications.
``least-loaded`` takes the smallest load (a tie: the lowest rank). ``prefix-affinity`` hashes the
prompt's first full blocks like the prefix cache and sends it to the rank last sent its longest
known prefix, unless that rank is busier than the least loaded by more than ``slack``. Routing
changes which process computes a request, never what it computes.

vLLM: ``DPLBAsyncMPClient.get_core_engine_for_request`` in ``vllm/v1/engine/core_client.py``;
prefix-aware routing vLLM leaves to an external router or ``vllm/v1/engine/dp_prefix_cache_router.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

LEAST_LOADED = "least-loaded"
PREFIX_AFFINITY = "prefix-affinity"
ROUTING_POLICIES = (LEAST_LOADED, PREFIX_AFFINITY)
MAX_PREFIX_BLOCKS = 8  # how deep a prompt's prefix is keyed
TABLE_SIZE = 1 << 16


def rank_load(waiting: int, running: int, in_flight: int, api_server_count: int) -> float:
    return float(max(waiting + running, api_server_count * in_flight))


def check_routing(policy: str) -> None:
    if policy not in ROUTING_POLICIES:
        raise ValueError(f"dp_routing: must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}")


def least_loaded(loads: Mapping[int, float]) -> int:
    return min(loads, key=lambda rank: (loads[rank], rank))


class Router:
    """``choose(loads, prompt_token_ids, cache_salt)``: the rank for one request (``loads`` holds the live ranks)."""

    def __init__(self, policy: str, block_size: int, slack: float, max_prefix_blocks: int = MAX_PREFIX_BLOCKS,
                 table_size: int = TABLE_SIZE):
        check_routing(policy)
        self.policy = policy
        self.block_size = block_size
        self.slack = slack
        self.max_prefix_blocks = max_prefix_blocks
        self.table_size = table_size
        self._owner: OrderedDict[int, int] = OrderedDict()  # prefix key -> the rank last sent it
        self.affinity_hits = 0  # requests sent to their prefix's rank
        self.affinity_overridden = 0  # requests whose prefix's rank was too loaded

    def prefix_keys(self, token_ids: Sequence[int], cache_salt: str | None) -> list[int]:
        """One key per full block of the prompt's first ``max_prefix_blocks``, each covering all before it."""
        keys, key = [], hash(("prefix", cache_salt))
        num_blocks = min(len(token_ids) // self.block_size, self.max_prefix_blocks)
        for i in range(num_blocks):
            key = hash((key, tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])))
            keys.append(key)
        return keys

    def choose(self, loads: Mapping[int, float], token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        assert loads, "no live rank to route to"
        best = least_loaded(loads)
        if self.policy == LEAST_LOADED:
            return best
        keys = self.prefix_keys(token_ids, cache_salt)
        chosen = best
        for key in reversed(keys):  # the longest known prefix first
            owner = self._owner.get(key)
            if owner is None or owner not in loads:
                continue
            if loads[owner] <= loads[best] + self.slack:
                chosen = owner
                self.affinity_hits += 1
            else:
                self.affinity_overridden += 1
            break
        for key in keys:
            self._owner[key] = chosen
            self._owner.move_to_end(key)
        while len(self._owner) > self.table_size:
            self._owner.popitem(last=False)
        return chosen
