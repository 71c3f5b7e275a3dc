"""The compiled step (``model/compile.py``): every step runs a graph compiled at start-up (decode rows
padded to a bucket, verify steps and short chunks as decode rows, prompts beside decodes), none compiles
while serving, and its tokens are logprob-close to the eager forward's and to the float32 reference, on
every kind of linear layer; its attention operator against the reference, with a step's queries of
several positions as one row per token; and when the engine arguments turn it on."""

from __future__ import annotations

import pytest
import torch

from shared import SamplingParams
from shared.closeness import as_token_logprobs, first_divergences
from stage2_paged.attention import PagedAttentionMetadata, paged_attention
from stage5_server import LLM
from stage5_server.config import EngineConfig
from stage5_server.cpu_kernels import cpu_decode_step_attention, load_cpu_kernels
from stage5_server.model import CompiledForward
from stage5_server.model.compile import one_row_per_token
from tests.invariants.prompts import PROMPTS
from tests.stage5.test_cpu_attention import make_paged_batch
from tests.stage5.test_quantization import bf16_packs

pytestmark = pytest.mark.skipif(load_cpu_kernels() is not None,
                                reason=f"the C++ decode operator did not build: {load_cpu_kernels()}")


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_step_attention_writes_each_rows_kv_and_attends_like_the_reference(dtype, tolerance):
    seq_lens = [1, 17, 70, 33]
    query, key_cache, value_cache, tables, lens, starts = make_paged_batch(
        seq_lens, [1] * 4, block_size=16, num_heads=6, num_kv_heads=2, head_dim=32, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    key, value = (torch.randn(4, 2, 32, generator=gen).to(dtype) for _ in range(2))
    positions = torch.tensor(seq_lens) - 1  # each row's token is its sequence's last
    slots = (tables[torch.arange(4), positions // 16].long() * 16 + positions % 16)
    slots[2] = -1  # padding: written nowhere, so row 2 attends the cache as it was
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    keep = slots >= 0
    expected_k.view(-1, 2, 32)[slots[keep]] = key[keep]
    expected_v.view(-1, 2, 32)[slots[keep]] = value[keep]

    out = cpu_decode_step_attention(query, key, value, key_cache, value_cache, slots, tables, lens, 32 ** -0.5)

    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    reference = paged_attention(query.float(), key_cache.float(), value_cache.float(), tables, lens, starts,
                                32 ** -0.5)
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_step_of_several_positions_a_request_attends_causally_as_one_decode_row_per_token(dtype, tolerance):
    """A verify step (5 positions after 16 cached), a decode, and a 3-token prompt: each token a row
    that sees its request up to itself, including the rows before it written in the same call."""
    seq_lens, q_lens = [21, 9, 3], [5, 1, 3]
    query, key_cache, value_cache, tables, lens, starts = make_paged_batch(
        seq_lens, q_lens, block_size=8, num_heads=6, num_kv_heads=2, head_dim=32, dtype=dtype)
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(seq_lens, q_lens)])
    owner = torch.repeat_interleave(torch.arange(3), torch.tensor(q_lens))
    slots = tables[owner, positions // 8].long() * 8 + positions % 8
    gen = torch.Generator().manual_seed(2)
    key, value = (torch.randn(9, 2, 32, generator=gen).to(dtype) for _ in range(2))
    meta = PagedAttentionMetadata(slots, starts, lens, tables, max_query_len=5, max_seq_len=21)

    rows = one_row_per_token(meta, positions)
    out = cpu_decode_step_attention(query, key, value, key_cache, value_cache, rows.slot_mapping,
                                    rows.block_tables, rows.seq_lens, 32 ** -0.5)

    assert rows.seq_lens.tolist() == [17, 18, 19, 20, 21, 9, 1, 2, 3]
    assert torch.equal(key_cache.view(-1, 2, 32)[slots], key)  # the step's K/V, then the attention:
    reference = paged_attention(query.float(), key_cache.float(), value_cache.float(), tables, lens, starts,
                                32 ** -0.5)  # causal over the cache as written
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance)


def test_decode_step_attention_refuses_a_slot_past_the_cache_before_writing_any():
    query, key_cache, value_cache, tables, lens, _ = make_paged_batch(
        [5, 9], [1, 1], block_size=16, num_heads=2, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    kv = torch.zeros(2, 2, 16)
    past = torch.tensor([0, key_cache.shape[0] * 16])  # the first row's slot is fine, the second's is not
    before = key_cache.clone()
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_decode_step_attention(query, kv, kv, key_cache, value_cache, past, tables, lens, 0.25)
    assert torch.equal(key_cache, before)


def _run(model, eager: bool, prompts, max_tokens=10, dtype="bfloat16", **args):
    llm = LLM(model=str(model), device="cpu", dtype=dtype, max_model_len=256, block_size=8, enforce_eager=eager,
              max_num_seqs=16, max_num_batched_tokens=128, **{"prepack_linear": False, **args})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs], [as_token_logprobs(o.outputs[0].logprobs) for o in outs]


def _forward(llm) -> CompiledForward:
    return llm.engine.model_executor.collective_rpc(lambda worker: worker.model.forward)[0]


# 12 decode rows at once (padded to 16), short and long prompts: decode, one-row and mixed steps
SERVED_PROMPTS = [*PROMPTS, PROMPTS[1] * 3, *(f"request {i} of a busy server" for i in range(5))]


@pytest.fixture(scope="module")
def fp32_reference(tiny_llama):
    """Every step eager, float32, plain weights: the reference the compiled steps are held to."""
    _, ids, lps = _run(tiny_llama, True, SERVED_PROMPTS, dtype="float32")
    return ids, lps


@pytest.mark.parametrize("checkpoint", [
    dict(dtype="bfloat16"),  # a bfloat16 checkpoint, packed for oneDNN where this CPU allows
    pytest.param(dict(dtype="float32"), marks=pytest.mark.slow),  # a float32 checkpoint, packed
    pytest.param(dict(dtype="bfloat16", quantization="int4"), marks=pytest.mark.slow),  # 4 bits up to 8 rows
    pytest.param(dict(dtype="bfloat16", quantization="int8"), marks=pytest.mark.slow),
], ids=["bf16-packed", "fp32-packed", "int4-and-packed", "int8-and-packed"])
def test_every_step_runs_a_start_up_graph_and_stays_close_to_the_eager_reference(tiny_llama, fp32_reference,
                                                                                  checkpoint):
    """Decode steps of 1 to 12 rows, prompts beside decodes, a long prompt alone: each runs a graph
    compiled at start-up, none compiles later, and the tokens are logprob-close to eager float32 (a
    quantized model: to its own eager forward, since the bits themselves move a random model's logits)."""
    from torch._dynamo.utils import counters

    reference = fp32_reference
    if "quantization" in checkpoint:
        _, *reference = _run(tiny_llama, True, SERVED_PROMPTS, prepack_linear=True, **checkpoint)
    llm, _, _ = _run(tiny_llama, False, ["warm"], max_tokens=1, prepack_linear=True, **checkpoint)
    forward = _forward(llm)
    graphs, steps_before = counters["stats"]["unique_graphs"], llm.engine.stats().num_steps
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    outs = llm.generate(SERVED_PROMPTS, params, use_tqdm=False)

    assert counters["stats"]["unique_graphs"] == graphs and forward.recompiles_refused == 0  # nothing compiled
    assert forward.compiled_steps == 1 + llm.engine.stats().num_steps - steps_before  # the warm-up's step and all
    divergences = first_divergences([o.outputs[0].token_ids for o in outs],
                                    [as_token_logprobs(o.outputs[0].logprobs) for o in outs], *reference)
    assert all(d.close for d in divergences), divergences


def test_compiled_steps_are_logprob_close_to_eager_and_compile_only_at_start_up(tiny_llama):
    from torch._dynamo.utils import counters

    _, ids_eager, lps_eager = _run(tiny_llama, True, SERVED_PROMPTS)
    graphs_before = counters["stats"]["unique_graphs"]
    llm, ids, lps = _run(tiny_llama, False, SERVED_PROMPTS)
    assert counters["stats"]["unique_graphs"] - graphs_before == 3  # one row; 2 to 8 rows; any step of more
    forward = _forward(llm)
    assert forward.compiled_steps == llm.engine.stats().num_steps and forward.recompiles_refused == 0
    divergences = first_divergences(ids, lps, ids_eager, lps_eager)
    assert all(d.close for d in divergences), divergences
    assert len(divergences) < len(SERVED_PROMPTS) // 2  # most prompts agree all the way


def test_a_decode_step_is_padded_to_the_next_bucket_with_rows_that_write_nothing():
    from stage5_server.model.compile import DECODE_BUCKETS, decode_buckets, padded_decode_rows, step_inputs

    assert decode_buckets(16) == (1, 2, 4, 8, 16) and decode_buckets(12) == (1, 2, 4, 8, 12)
    assert decode_buckets(10_000)[-1] == DECODE_BUCKETS[-1]
    meta = PagedAttentionMetadata(torch.tensor([5, 9, 30]), torch.arange(4, dtype=torch.int32),
                                  torch.tensor([6, 10, 31], dtype=torch.int32),
                                  torch.tensor([[0], [1], [3]], dtype=torch.int32), 1, 31)
    ids, positions, padded = padded_decode_rows(torch.tensor([7, 8, 9]), torch.tensor([5, 9, 30]), meta, 4)
    assert ids.tolist() == [7, 8, 9, 0] and padded.slot_mapping.tolist() == [5, 9, 30, -1]
    assert padded.seq_lens.tolist() == [6, 10, 31, 1] and padded.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert padded.block_tables.tolist() == [[0, 0], [1, 0], [3, 0], [0, 0]]  # two blocks wide at least
    # a decode step for the any-step graph: padding sequences of one token each
    ids, positions, padded = step_inputs(torch.tensor([7, 8, 9]), torch.tensor([5, 9, 30]), meta, 4)
    assert ids.tolist() == [7, 8, 9, 0] and padded.slot_mapping.tolist() == [5, 9, 30, -1]
    assert padded.query_start_loc.tolist() == [0, 1, 2, 3, 4] and padded.seq_lens.tolist() == [6, 10, 31, 1]
    assert padded.max_query_len == 0  # no guard reads the step's numbers


def test_a_step_no_graph_fits_runs_eagerly_and_is_counted_instead_of_compiling(tiny_llama):
    """Serving never waits for a compiler: a step whose inputs fail every graph's guards (here: block
    positions of another dtype) runs the eager forward, and the refusal is counted."""
    from torch._dynamo.utils import counters

    llm, _, _ = _run(tiny_llama, False, ["warm"], max_tokens=1)
    forward = _forward(llm)
    graphs = counters["stats"]["unique_graphs"]
    meta = PagedAttentionMetadata(torch.tensor([0, 8]), torch.arange(3, dtype=torch.int32),
                                  torch.ones(2, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32), 1, 1)
    hidden = forward(torch.tensor([3, 4]), torch.zeros(2, dtype=torch.int32), meta)
    assert hidden.shape[0] == 2 and forward.recompiles_refused == 1
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_in_the_background_the_first_steps_run_eagerly_and_the_graphs_take_over(tiny_llama):
    import time

    _, ids_eager, lps_eager = _run(tiny_llama, True, list(PROMPTS))
    llm, ids, lps = _run(tiny_llama, None, list(PROMPTS), compile_in_background=True)  # eager while it compiles
    assert all(d.close for d in first_divergences(ids, lps, ids_eager, lps_eager))
    deadline = time.monotonic() + 600
    while not isinstance(_forward(llm), CompiledForward):
        assert time.monotonic() < deadline, "the background compile never finished"
        time.sleep(0.5)
    steps = llm.engine.stats().num_steps
    outs = llm.generate(list(PROMPTS), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5),
                        use_tqdm=False)
    assert _forward(llm).compiled_steps == llm.engine.stats().num_steps - steps
    divergences = first_divergences([o.outputs[0].token_ids for o in outs],
                                    [as_token_logprobs(o.outputs[0].logprobs) for o in outs], ids_eager, lps_eager)
    assert all(d.close for d in divergences), divergences


def test_int8_linears_compile_and_stay_logprob_close_to_eager(tiny_llama):
    """On an AVX512-VNNI CPU the int8 method's operator runs inside the graph (its fake kernel traces)."""
    _, ids_eager, lps_eager = _run(tiny_llama, True, list(PROMPTS), quantization="int8")
    llm, ids, lps = _run(tiny_llama, False, list(PROMPTS), quantization="int8")
    assert _forward(llm).compiled_steps == llm.engine.stats().num_steps
    divergences = first_divergences(ids, lps, ids_eager, lps_eager)
    assert all(d.close for d in divergences), divergences


def test_verify_steps_and_short_prompts_run_the_start_up_graphs_and_stay_close_to_eager(tiny_llama):
    """Drafts replayed from the eager run (some wrong on purpose, ``ReplayProposer``), so verify steps
    accept and reject: each step runs a graph compiled at start-up, verify steps as decode rows."""
    from torch._dynamo.utils import counters

    from stage5_server.spec_decode import NgramDrafter
    from tests.stage5.test_spec_decode import ReplayProposer

    prompts = [PROMPTS[1] * 3, "one two"]  # 63 tokens (a mixed step), and 5 (decode rows from its first step)
    _, ids_eager, lps_eager = _run(tiny_llama, True, prompts, max_tokens=16)
    graphs_before = counters["stats"]["unique_graphs"]
    llm, _, _ = _run(tiny_llama, False, [[1, 2]], max_tokens=1)
    runs = [llm.tokenizer.encode(p) + ids for p, ids in zip(prompts, ids_eager)]
    llm.engine.drafter = NgramDrafter(ReplayProposer(runs, k=3, vocab_size=llm.tokenizer.vocab_size))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]  # one at a time

    assert counters["stats"]["unique_graphs"] - graphs_before == 3  # the start-up ones, nothing new
    stats = llm.engine.stats()
    spec = stats.spec_decoding
    assert spec.num_accepted_tokens > 0 and spec.num_accepted_tokens < spec.num_draft_tokens
    forward = _forward(llm)
    assert forward.compiled_steps == stats.num_steps and forward.recompiles_refused == 0
    divergences = first_divergences([o.token_ids for o in outs], [as_token_logprobs(o.logprobs) for o in outs],
                                    ids_eager, lps_eager)
    assert all(d.close for d in divergences), divergences


def test_with_lora_the_steps_without_adapters_run_compiled_and_the_others_eagerly(tiny_llama, tmp_path):
    from stage5_server import LoRARequest
    from tests.stage5.lora_adapters import make_adapter

    lora = LoRARequest("every", 1, str(make_adapter(tiny_llama, tmp_path / "every", seed=1)))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    runs = {}
    for eager in (True, None):
        llm = LLM(model=str(tiny_llama), device="cpu", dtype="bfloat16", max_model_len=256, block_size=8,
                  enforce_eager=eager, enable_lora=True)
        base = llm.generate(list(PROMPTS), params, use_tqdm=False)
        steps = llm.engine.stats().num_steps
        adapted = llm.generate(list(PROMPTS), params, use_tqdm=False, lora_request=lora)
        runs[eager] = base + adapted
    forward = _forward(llm)
    assert forward.compiled_steps == steps  # every step without an adapter, and only those
    ids, lps = ({e: [o.outputs[0].token_ids for o in runs[e]] for e in runs},
                {e: [as_token_logprobs(o.outputs[0].logprobs) for o in runs[e]] for e in runs})
    divergences = first_divergences(ids[None], lps[None], ids[True], lps[True])
    assert all(d.close for d in divergences), divergences


def test_weights_packed_for_onednn_run_inside_the_compiled_step(tiny_llama, caplog):
    """Packed weights no longer keep steps eager: the packed product is an operator the graphs hold. Where
    oneDNN cannot pack bfloat16 (no AVX-512), the layers keep their plain weights and compile all the same."""
    from stage5_server.model import Linear

    with caplog.at_level("INFO", logger="stagedserve"):
        llm, _, _ = _run(tiny_llama, None, ["one prompt", "another prompt"], max_tokens=3, prepack_linear=True)
    forward = _forward(llm)
    assert isinstance(forward, CompiledForward) and "runs eagerly" not in caplog.text
    assert forward.compiled_steps == llm.engine.stats().num_steps and forward.recompiles_refused == 0
    packed = llm.engine.model_executor.collective_rpc(
        lambda worker: [getattr(m, "packed_weight", None) is not None for m in worker.model.modules()
                        if isinstance(m, Linear)])[0]
    assert any(packed) == bf16_packs()  # packed where this CPU packs bfloat16, plain elsewhere


def test_enforce_eager_and_the_dtype_decide_when_steps_compile(tiny_llama):
    def compiles(**args):
        return EngineConfig.create(str(tiny_llama), device="cpu", **args).compile_step

    assert compiles(dtype="bfloat16")  # the CPU fast path
    assert not compiles(dtype="float32")  # the reference stays eager
    assert compiles(dtype="float32", enforce_eager=False)
    assert not compiles(dtype="bfloat16", enforce_eager=True)
    assert not compiles(dtype="bfloat16", attention_backend="torch")
    with pytest.raises(ValueError, match="enforce_eager=False: the compiled step runs on a CPU"):
        compiles(dtype="bfloat16", attention_backend="torch", enforce_eager=False)
    assert compiles(dtype="bfloat16", enable_lora=True)  # the steps without adapters


def test_where_inductor_cannot_compile_every_step_runs_eagerly_and_says_why(tiny_llama, tmp_path):
    """Inductor needs a C++ compiler when the engine starts (here: no such compiler, an empty cache)."""
    import os
    import subprocess
    import sys

    code = ("import logging\n"
            "logging.basicConfig(level=logging.INFO)\n"
            "from shared import SamplingParams\n"
            "from stage5_server import LLM\n"
            f"llm = LLM(model={str(tiny_llama)!r}, device='cpu', dtype='bfloat16', prepack_linear=False,"
            " max_model_len=128)\n"
            "params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)\n"
            "print(len(llm.generate(['hello'], params, use_tqdm=False)[0].outputs[0].token_ids))\n")
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "4"
    assert "every step runs eagerly: compiling failed" in run.stderr, run.stderr[-3000:]
