"""``stagedserve bench``: load a server over the OpenAI API and report what users got.

- ``datasets``: the workloads (random, shared-prefix, two-phase, a JSON file of prompts).
- ``serve``: the async load generator; every request's full timeline.
- ``goodput``: which requests count and what they are divided by (pure functions).
- ``report``: the numbers, the printed table, the JSON file and the plot.
- ``cli``: ``stagedserve bench serve|sweep`` (``add_bench_subcommands``).

vLLM: ``vllm/benchmarks/serve.py`` (``vllm bench serve``) and ``vllm/benchmarks/datasets.py``.
"""
