"""Benchmark workloads: what each request sends, built from the course's ``course/workloads.py``.

- ``random``: ShareGPT-like lengths (``course.workloads.sharegpt_like_lengths``: independent
  log-normal prompt and output lengths, medians ``prompt_len`` / ``output_len``, sigma
  ``len_sigma``, clipped to ``[4, max_prompt_len]`` / ``[4, max_output_len]``), filled with
  seeded uniform random token ids in ``[3, vocab_size)``.
- ``shared-prefix``: one shared random prefix of ``prefix_len`` tokens + distinct 8-32 token
  suffixes (``course.workloads.shared_prefix_prompts``); with ``num_prefixes`` > 1, that many
  distinct prefixes (say, system prompts), the requests of each group in a seeded shuffled order.
- ``two-phase``: the internals chapter's lab load (``course.workloads.two_phase_load``):
  phase 1 a burst of short requests behind one long system prompt; phase 2, after phase 1
  has drained and a pause, two very long prompts among more short ones. ``num_prompts``
  scales the phases (the chapter's 22 = 12 + 8 short + 2 long).
- ``json``: a file holding a list of prompt strings or of ``{"prompt", "max_tokens"}``.

Token-id prompts go to ``/v1/completions`` as ids, so the server sees exactly these
lengths. ``vocab_size`` defaults to 256: ids below 256 are ordinary byte tokens in every
byte-level BPE vocabulary, so the prompts are valid for any such model.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

DATASETS = ("random", "shared-prefix", "two-phase", "json")


@dataclass
class BenchRequest:
    """One request to send: a prompt (text or token ids) and its output budget."""

    prompt: str | list[int]
    max_tokens: int
    phase: int = 1
    kind: str = "short"
    meta: dict = field(default_factory=dict)

    @property
    def prompt_len(self) -> int | None:
        """Prompt tokens when the prompt is token ids; None for text (the server's usage tells)."""
        return len(self.prompt) if isinstance(self.prompt, list) else None


@dataclass
class DatasetConfig:
    name: str = "random"
    num_prompts: int | None = None  # None: the dataset's default (100; the whole file for json)
    seed: int = 0
    vocab_size: int = 256
    max_tokens: int | None = None  # overrides every request's output budget
    prompt_len: int = 100  # random: median prompt length
    output_len: int = 200  # random: median output length
    len_sigma: float = 1.0  # random: log-normal sigma of both
    max_prompt_len: int = 1024
    max_output_len: int = 1024
    prefix_len: int = 384  # shared-prefix / two-phase: shared system prompt tokens
    num_prefixes: int = 1  # shared-prefix: distinct shared prefixes
    long_prompt_len: int = 1024  # two-phase: the long prompts
    path: str | None = None  # json


def build_dataset(cfg: DatasetConfig, *, seed: int | None = None) -> list[BenchRequest]:
    """The requests of ``cfg``, in send order; ``seed`` overrides ``cfg.seed`` (warm-up uses another seed)."""
    # The course's workloads (no engine needs them: imported by the bench command alone).
    from course.workloads import random_token_prompts, shared_prefix_prompts, sharegpt_like_lengths, two_phase_load

    seed = cfg.seed if seed is None else seed
    n = cfg.num_prompts
    if n is not None and n < 1:
        raise ValueError(f"num_prompts: must be >= 1, got {n}")
    if cfg.max_tokens is not None and cfg.max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {cfg.max_tokens}")
    if cfg.name == "random":
        n = 100 if n is None else n
        pairs = sharegpt_like_lengths(n, seed, prompt_median=cfg.prompt_len, prompt_sigma=cfg.len_sigma,
                                      output_median=cfg.output_len, output_sigma=cfg.len_sigma,
                                      max_prompt_len=cfg.max_prompt_len, max_output_len=cfg.max_output_len)
        prompts = random_token_prompts([p for p, _ in pairs], cfg.vocab_size, seed)
        reqs = [BenchRequest(p, o) for p, (_, o) in zip(prompts, pairs)]
    elif cfg.name == "shared-prefix":
        n = 100 if n is None else n
        if cfg.num_prefixes < 1:
            raise ValueError(f"num_prefixes: must be >= 1, got {cfg.num_prefixes}")
        if cfg.num_prefixes == 1:
            groups = [shared_prefix_prompts(n, cfg.prefix_len, cfg.vocab_size, seed)]
        else:
            groups = [shared_prefix_prompts(len(range(g, n, cfg.num_prefixes)), cfg.prefix_len, cfg.vocab_size,
                                            seed * 1000 + g) for g in range(cfg.num_prefixes)]
        tagged = [(g, p) for g, prompts in enumerate(groups) for p in prompts]
        if cfg.num_prefixes > 1:
            random.Random(seed).shuffle(tagged)
        reqs = [BenchRequest(p, 32, meta={"shared_prefix_len": cfg.prefix_len, "prefix_group": g})
                for g, p in tagged]
    elif cfg.name == "two-phase":
        n = 22 if n is None else n
        if n < 3:
            raise ValueError(f"num_prompts: two-phase needs >= 3 requests, got {n}")
        num_long = max(1, round(n * 2 / 22))
        short = n - num_long
        phase1 = max(1, math.ceil(short * 12 / 20))
        load = two_phase_load(cfg.vocab_size, seed, system_prompt_len=cfg.prefix_len, num_short_phase1=phase1,
                              num_short_phase2=short - phase1, num_long=num_long,
                              long_prompt_len=cfg.long_prompt_len, short_max_tokens=128, long_max_tokens=256)
        reqs = [BenchRequest(w.prompt_token_ids, w.max_tokens, w.phase, w.kind) for w in load]
    elif cfg.name == "json":
        reqs = load_json_prompts(cfg.path)
        if n is not None:
            if n > len(reqs):
                raise ValueError(f"num_prompts: {n} > the {len(reqs)} prompts in {cfg.path}")
            reqs = reqs[:n]
    else:
        raise ValueError(f"dataset: must be one of {', '.join(DATASETS)}, got {cfg.name!r}")
    if cfg.max_tokens is not None:
        for r in reqs:
            r.max_tokens = cfg.max_tokens
    return reqs


def load_json_prompts(path: str | Path | None) -> list[BenchRequest]:
    """``["text", ...]`` or ``[{"prompt": "text", "max_tokens": 64}, ...]`` (max_tokens defaults to 128)."""
    if path is None:
        raise ValueError("dataset_path: the json dataset needs --dataset-path FILE.json")
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list) or not data:
        raise ValueError(f"dataset_path: {path} must hold a non-empty JSON list")
    reqs = []
    for i, item in enumerate(data):
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise ValueError(f"dataset_path: item {i} must be a non-empty string or an object with a 'prompt' string")
        max_tokens = item.get("max_tokens", 128)
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"dataset_path: item {i}: max_tokens must be a positive integer, got {max_tokens!r}")
        reqs.append(BenchRequest(item["prompt"], max_tokens))
    return reqs
