"""n samples of one prompt through stage 4: what the prefix-cache counters say they cost.

One request with n = 8 becomes eight child requests in the front end. Child 0 computes the
prompt and registers its full blocks; children 1..7 find them and compute only the last,
partial block (its logits are needed). A second run asks for prompt logprobs as well: only
child 0 computes them, so the others still read the cache. Tiny random checkpoint, block size 4.

Run: .venv/bin/python docs/snippets/parallel_sampling_cache.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, however this is run

from course import cached_tiny_model  # noqa: E402
from shared import SamplingParams, Tokenizer  # noqa: E402
from stage4_prefix_cache import LLM  # noqa: E402

PROMPT = "A serving engine turns prompts into tokens, schedules them, and streams text back."


MODEL = cached_tiny_model("llama")


def run(case: str, params: SamplingParams, enable_prefix_caching: bool) -> None:
    llm = LLM(model=str(MODEL), block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
              max_model_len=128, enable_prefix_caching=enable_prefix_caching)
    [out] = llm.generate(PROMPT, params, use_tqdm=False)
    stats = llm.engine.stats()
    scored = "-" if out.prompt_logprobs is None else str(len(out.prompt_logprobs))
    hits = f"{stats.prefix_cache_hits}/{stats.prefix_cache_queries}"
    print(f"{case:<16}{'on' if enable_prefix_caching else 'off':>7}{len(out.outputs):>6}{scored:>12}"
          f"{stats.num_prompt_tokens_computed:>10}{hits:>14}")


print(f"prompt: {len(Tokenizer(MODEL).encode(PROMPT))} tokens, block size 4, n = 8")
print(f"{'case':<16}{'caching':>7}{'outs':>6}{'prompt lps':>12}{'computed':>10}{'hits/lookups':>14}")
for case, params in (("sampling only", SamplingParams(n=8, temperature=1.0, max_tokens=4, seed=0)),
                     ("prompt logprobs", SamplingParams(n=8, temperature=1.0, max_tokens=4, seed=0,
                                                        prompt_logprobs=1))):
    for caching in (False, True):
        run(case, params, caching)
