"""Weight updates from a trainer: how long an update takes, and an RL-style loop against restarting.

Two questions a trainer asks of the engine it generates rollouts with (``stage5_server/weight_sync/``):

1. **Update latency**: the time from a trainer's tensors to an engine that serves them, for the whole
   model. In-process, ``LLM.update_weights`` takes the tensors from the caller; over gloo, a trainer in
   another process broadcasts each tensor to the engine's workers (``WeightBroadcaster`` on the trainer's
   side, ``update_weights_from_distributed`` on the engine's), the way an RL trainer on its own devices
   pushes weights. Each is timed ``--repeats`` times; the table shows the median.
2. **The loop**: ``--rounds`` rounds of *generate a batch, then take new weights*, done two ways in the
   same run: by an update (the engine stays up; its prefix cache is reset) and by what a trainer without
   one does, writing the weights as a checkpoint and starting a new engine from it. Each round's batch is
   ``--batch-size`` prompts of ``--output-len`` greedy tokens; rollout throughput is the batch's output
   tokens over the round's wall time (generation and the weight change together).

The new weights are the checkpoint's own with seeded noise added (a stand-in for a training step): the
engine's work per update is the same whatever the values. The default model is read from its converted
float checkpoint (a GGUF file's 4-bit blocks take no updates).

    python -m benchmarks.weight_updates [--dtype float32 --repeats 3 --rounds 3 --batch-size 16 --output-len 32]
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import benchmark_parser, provenance, run_info, write_results
from shared import SamplingParams

PROMPTS = ["Write one sentence about paged attention.", "Name three uses of a KV cache.",
           "Explain continuous batching to a new engineer.", "What does a scheduler's token budget bound?"]


def checkpoint_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def nudged(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Every float tensor plus seeded noise at 1% of its scale: one "training step"."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in tensors.items():
        if tensor.is_floating_point():
            noise = torch.randn(tensor.shape, generator=generator) * (0.01 * tensor.float().std().nan_to_num())
            tensor = (tensor.float() + noise).to(tensor.dtype)
        out[name] = tensor
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_main(path: str, port: int, world_size: int, seed: int) -> None:
    """A trainer process: its (nudged) weights broadcast to the engine's workers over gloo."""
    from stage5_server.weight_sync import WeightBroadcaster

    WeightBroadcaster("127.0.0.1", port, world_size).send(nudged(checkpoint_tensors(path), seed).items())


def update_over_gloo(llm, path: str, seed: int) -> float:
    """Seconds from the trainer's first byte to an engine serving the new weights (the trainer's start-up
    and reading the checkpoint are not counted: the group is joined first)."""
    import secrets

    from stage5_server.weight_sync import describe_tensors

    os.environ.setdefault("STAGEDSERVE_WEIGHT_SYNC_SECRET", secrets.token_hex(32))  # both ends read it
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(target=trainer_main, args=(path, port, 2, seed))
    trainer.start()
    try:
        llm.collective_rpc("init_weight_update_group", args=("127.0.0.1", port, 1, 2))  # joins on a thread
        while not all(llm.collective_rpc("weight_update_group_ready")):
            time.sleep(0.05)
        metadata = describe_tensors(checkpoint_tensors(path).items())
        start = time.perf_counter()
        llm.update_weights_from_distributed(metadata)
        seconds = time.perf_counter() - start
        trainer.join(120)
        if trainer.exitcode != 0:
            raise RuntimeError(f"the trainer process exited with {trainer.exitcode}")
        return seconds
    finally:
        if trainer.is_alive():
            trainer.kill()


def output_tokens(outputs) -> int:
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def write_checkpoint(source: Path, tensors: dict[str, torch.Tensor], directory: Path) -> Path:
    """``source``'s config and tokenizer with ``tensors`` as its weights."""
    from safetensors.torch import save_file

    if directory.exists():
        shutil.rmtree(directory)
    shutil.copytree(source, directory, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def run(model_path: Path, engine_args: dict, repeats: int, rounds: int, batch_size: int, output_len: int,
        scratch: Path) -> dict:
    from stage5_server import LLM

    base = checkpoint_tensors(model_path)
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(batch_size)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    size_mib = sum(t.numel() * t.element_size() for t in base.values()) / 2**20

    llm = LLM(str(model_path), **engine_args, enable_weight_sync=True)
    try:
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm
        in_process, gloo = [], []
        for r in range(repeats):
            new = nudged(base, seed=100 + r)
            start = time.perf_counter()
            llm.update_weights(new.items())
            in_process.append(time.perf_counter() - start)
            gloo.append(update_over_gloo(llm, str(model_path), seed=200 + r))
        updated = []  # the loop, with updates
        for r in range(rounds):
            start = time.perf_counter()
            tokens = output_tokens(llm.generate(prompts, params, use_tqdm=False))
            llm.update_weights(nudged(base, seed=300 + r).items())
            updated.append((time.perf_counter() - start, tokens))
    finally:
        llm.shutdown()

    restarted = []  # the same loop by a new engine from a written checkpoint each round
    engine = LLM(str(model_path), **engine_args)
    try:
        for r in range(rounds):
            start = time.perf_counter()
            tokens = output_tokens(engine.generate(prompts, params, use_tqdm=False))
            path = write_checkpoint(model_path, nudged(base, seed=300 + r), scratch / f"round{r}")
            engine.shutdown()
            engine = LLM(str(path), **engine_args)
            restarted.append((time.perf_counter() - start, tokens))
    finally:
        engine.shutdown()

    def loop_row(name: str, runs: list[tuple[float, int]]) -> dict:
        seconds = sum(s for s, _ in runs)
        return {"way": name, "round_s": statistics.median(s for s, _ in runs),
                "output_tokens_per_s": sum(t for _, t in runs) / seconds}

    return {"weights_mib": size_mib, "num_tensors": len(base),
            "update_s": {"in_process": statistics.median(in_process), "over_gloo": statistics.median(gloo),
                         "in_process_all": in_process, "over_gloo_all": gloo},
            "loop": [loop_row("update the running engine", updated),
                     loop_row("write a checkpoint, start a new engine", restarted)]}


def to_markdown(result: dict) -> str:
    config, rows = result["config"], result["rows"]
    update = rows["update_s"]
    lines = [provenance(result, f"{config['model']}, {config['dtype']}, load {result['load_before']:.1f} before"),
             "",
             f"Updating all {rows['num_tensors']} tensors ({rows['weights_mib']:.0f} MiB), median of "
             f"{config['repeats']}:",
             "",
             "| from | seconds |",
             "|---|---:|",
             f"| tensors in the caller's process (`LLM.update_weights`) | {update['in_process']:.3f} |",
             f"| a trainer process, broadcast over gloo | {update['over_gloo']:.3f} |",
             "",
             f"{config['rounds']} rounds of {config['batch_size']} prompts x {config['output_len']} greedy tokens, "
             "then new weights:",
             "",
             "| way | seconds a round (median) | rollout output tokens/s |",
             "|---|---:|---:|"]
    for row in rows["loop"]:
        lines.append(f"| {row['way']} | {row['round_s']:.2f} | {row['output_tokens_per_s']:.1f} |")
    first, second = rows["loop"]
    lines += ["", f"Updating in place gives {first['output_tokens_per_s'] / second['output_tokens_per_s']:.2f}x "
                  "the rollout throughput of restarting, measured side by side in this run.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = benchmark_parser(__doc__, "weight_updates")
    ap.add_argument("--model", default=None, help="a float checkpoint directory; default: the default model's")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args(argv)
    if args.model is None:
        from shared.named_models import default_model

        model_path = Path(default_model())
    else:
        model_path = Path(args.model)
    engine_args = {"dtype": args.dtype, "device": "cpu", "quantization": "none", "max_model_len": 512}
    load_before, start = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        rows = run(model_path, engine_args, args.repeats, args.rounds, args.batch_size, args.output_len, Path(scratch))
    result = {**run_info("benchmarks.weight_updates", argv), "load_before": load_before,
              "load_after": os.getloadavg()[0], "runtime_s": time.perf_counter() - start,
              "config": {"model": model_path.name if args.model else "default", "dtype": args.dtype,
                         "repeats": args.repeats, "rounds": args.rounds, "batch_size": args.batch_size,
                         "output_len": args.output_len},
              "rows": rows}
    write_results("weight_updates", result, to_markdown(result), args.out_dir, args.markdown)
    return result


if __name__ == "__main__":
    main()
