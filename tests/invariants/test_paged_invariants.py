"""Promises of every paged stage (2 and later)."""

from __future__ import annotations

from shared import SamplingParams
from tests.invariants.prompts import PROMPTS
from tests.stage5.server_fixtures import engine_kv_cache

MIN_STAGE = 2
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _no_sharing_kwargs(stage):
    return {"enable_prefix_caching": False} if stage.number >= 4 else {}


def test_outputs_do_not_depend_on_physical_block_order(stage, tiny_llama):
    plain = stage.make_llm(tiny_llama).generate(list(PROMPTS), PARAMS, use_tqdm=False)
    shuffled = stage.make_llm(tiny_llama, block_shuffle_seed=7).generate(list(PROMPTS), PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in shuffled]


def test_live_block_tables_never_share_a_physical_block(stage, tiny_llama):
    llm = stage.make_llm(tiny_llama, block_shuffle_seed=1, **_no_sharing_kwargs(stage))
    for p in PROMPTS * 2:
        llm.add_request(p, PARAMS)
    steps = 0
    while llm.has_unfinished_requests():
        llm.step()
        steps += 1
        owners: dict[int, str] = {}
        for rid, blocks in llm.engine.live_block_ids().items():
            for b in blocks:
                assert b not in owners, f"block {b} held by {owners[b]} and {rid}"
                owners[b] = rid
    assert steps > 1


def test_every_written_slot_belongs_to_a_block_the_engine_gave_out(stage, tiny_llama, monkeypatch):
    llm = stage.make_llm(tiny_llama, **_no_sharing_kwargs(stage))
    cache = engine_kv_cache(llm)
    written_steps = []
    real_write = cache.write

    def checking_write(layer_idx, key, value, slot_mapping):
        if layer_idx == 0:  # at write time, the tables of the requests in this step are live
            given_out = {b for blocks in llm.engine.live_block_ids().values() for b in blocks}
            slots = slot_mapping.tolist()
            assert len(set(slots)) == len(slots) == key.shape[0], "one slot per new token"
            stray = [s for s in slots if s // cache.block_size not in given_out]
            assert not stray, f"slots {stray} lie in blocks no live request holds"
            written_steps.append(len(slots))
        return real_write(layer_idx, key, value, slot_mapping)

    monkeypatch.setattr(cache, "write", checking_write)
    llm.generate(list(PROMPTS), PARAMS, use_tqdm=False)
    # Every position but the last output's is written (a step that verifies drafts writes several).
    assert sum(written_steps) >= len(PROMPTS) * (PARAMS.max_tokens - 1)
