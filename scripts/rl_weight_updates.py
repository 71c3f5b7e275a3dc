"""A tiny RL-style loop on a CPU: serve a model, train a copy of it, push the weights, watch the outputs move.

    rollouts (the engine, greedy)  ->  a few SGD steps on a transformers copy toward a target token
    ->  llm.update_weights(model.state_dict().items())  (prefix cache reset, weight version + 1)  -> rollouts

Then the same update without the cache reset, measured: the prompt's cached blocks, computed by the old
weights, are reused, and the tokens differ from transformers' on the new weights.

    python scripts/rl_weight_updates.py [--rounds 4] [--steps 2] [--lr 0.05] [--target 42]

The course page: docs/rl-weight-updates.md. Runs in well under a minute on two cores.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from course import cached_tiny_model
from shared import SamplingParams
from stage5_server import LLM

PROMPT = list(range(3, 40))  # 37 tokens: two full blocks of 16 for the prefix cache
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def rollout(llm: LLM) -> list[int]:
    return list(llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def train_toward(model, target: int, tokens: list[int], steps: int, lr: float) -> float:
    """SGD steps raising the target's log-probability after every prefix of prompt + rollout; the last loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    ids = torch.tensor([PROMPT + tokens])
    loss = torch.tensor(0.0)
    for _ in range(steps):
        logits = model(ids).logits[0, len(PROMPT) - 1:]
        loss = -logits.log_softmax(-1)[:, target].mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def transformers_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def load_on_the_worker(worker, named_tensors) -> int:
    """The worker's weight method, run as a function: what the engine's own update adds (the drain, the cache
    reset, the version) is left out on purpose, to measure what the reset prevents. By name, through
    ``collective_rpc``, the method is refused."""
    return worker.extension.update_weights(named_tensors)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="SGD steps per round")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--target", type=int, default=42, help="the token id the trainer rewards")
    args = parser.parse_args(argv)
    logging.getLogger("stagedserve").setLevel(logging.WARNING)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    start = time.monotonic()
    path = cached_tiny_model("llama")
    llm = LLM(str(path), max_model_len=256, block_size=16, num_kv_blocks=64, max_num_seqs=4, enable_weight_sync=True)
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer.generation_config.eos_token_id = None

    share = lambda tokens: tokens.count(args.target) / len(tokens)  # noqa: E731
    tokens = rollout(llm)
    first = share(tokens)
    print(f"round 0: version {llm.weight_version}, target share {first:.2f}")
    print(f"  tokens: {tokens}")
    for round_ in range(1, args.rounds + 1):
        loss = train_toward(trainer, args.target, tokens, args.steps, args.lr)
        version = llm.update_weights(trainer.state_dict().items())  # between steps; the prefix cache is reset
        tokens = rollout(llm)
        same = tokens == transformers_greedy(trainer, PROMPT, GREEDY.max_tokens)
        print(f"round {round_}: loss {loss:.3f}, version {version}, target share {share(tokens):.2f}")
        print(f"  same tokens as transformers: {same}")
        print(f"  tokens: {tokens}")
    print(f"target share: {first:.2f} -> {share(tokens):.2f}")

    # Without the reset: one more training round, the weights swapped by the worker method alone.
    train_toward(trainer, args.target + 1, tokens, args.steps, args.lr)  # another target: the outputs must move
    expected = transformers_greedy(trainer, PROMPT, GREEDY.max_tokens)
    hits = llm.engine.stats().prefix_cache_hits
    llm.collective_rpc(load_on_the_worker, args=(list(trainer.state_dict().items()),))  # no drain, no reset
    stale = rollout(llm)
    stale_hits = llm.engine.stats().prefix_cache_hits - hits
    llm.reset_prefix_cache()
    fresh = rollout(llm)
    differ = sum(a != b for a, b in zip(stale, expected))
    print(f"without the reset: {stale_hits} prompt tokens from the cache, {differ} of {len(expected)} differ")
    print(f"with the reset: {sum(a != b for a, b in zip(fresh, expected))} differ")
    print(f"done in {time.monotonic() - start:.1f} s")
    llm.shutdown()


if __name__ == "__main__":
    main()
