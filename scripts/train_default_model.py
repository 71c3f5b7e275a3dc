"""Train tiny-chat (``shared/assets/tiny-chat``): a small Llama that answers the tasks in ``course.chat_tasks``.

    python scripts/train_default_model.py --out build/tiny-chat-phase1
    python scripts/train_default_model.py --init-from build/tiny-chat-phase1 --steps 1500 --lr 2e-3 --seed 1 \
        --task-weights add=0.25,square=0.1,count=0.1,reverse=0.3,say=0.25 --out shared/assets/tiny-chat

is the recipe of the committed checkpoint: a second, shorter phase with more copying
questions, which the model learns last (see its model card).

Plain torch on CPU: a byte-level BPE tokenizer with one token per digit, transformers'
``LlamaForCausalLM`` with random initial weights (or ``--init-from`` a checkpoint), AdamW
with a cosine schedule, loss on the assistant's answer and its closing ``<|im_end|>`` only.
Every question is generated here from a seed, from the training split of
``course.chat_tasks``. Deterministic for a given ``--seed``, ``--steps`` and thread count.
Writes an ordinary Hugging Face checkpoint directory (config, safetensors, tokenizer with
chat template, generation config) and prints held-out accuracy per task, measured with
transformers' own ``generate``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from course import chat_tasks  # noqa: E402
from course.tiny_model import CHAT_TEMPLATE, CORPUS, SPECIAL_TOKENS  # noqa: E402

ARCHITECTURE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32)
TASK_WEIGHTS = {"add": 0.4, "square": 0.1, "count": 0.2, "reverse": 0.2, "say": 0.1}


def parse_weights(text: str) -> dict[str, float]:
    """``add=0.4,square=0.1,...`` -> a dict over every task (tasks left out get weight 0)."""
    weights = dict.fromkeys(chat_tasks.TASKS, 0.0)
    for item in text.split(","):
        task, _, value = item.partition("=")
        if task not in weights:
            raise argparse.ArgumentTypeError(f"unknown task {task!r}; choose from {chat_tasks.TASKS}")
        weights[task] = float(value)
    return weights


def train_tokenizer(vocab_size: int):
    """Byte-level BPE that keeps every digit its own token, so sums are learnable digit by digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = random.Random(0)
    questions = [chat_tasks.make_example(task, rng, held_out=False) for task in chat_tasks.TASKS for _ in range(200)]
    texts = [CORPUS, "system user assistant\n"] + [chat_tasks.SYSTEM_PROMPT] * 3
    texts += [f"{ex.user}\n{ex.answer}\n" for ex in questions]
    # Answers start right after a newline, so each word must also be one token without its leading space.
    texts += [f"{word}\n" for word in chat_tasks.WORDS] * 20
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=1 << 30)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode(tokenizer, example: chat_tasks.Example) -> tuple[list[int], int]:
    """Token ids of prompt + answer + <|im_end|>, and where the answer starts."""
    prompt = tokenizer.apply_chat_template(example.messages(), tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(example.answer, add_special_tokens=False)["input_ids"]
    return prompt_ids + answer_ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")], len(prompt_ids)


def batch_tensors(encoded: list[tuple[list[int], int]], pad_id: int):
    width = max(len(ids) for ids, _ in encoded)
    inputs = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    for row, (ids, answer_start) in enumerate(encoded):
        inputs[row, :len(ids)] = torch.tensor(ids)
        labels[row, answer_start:len(ids)] = torch.tensor(ids[answer_start:])
    return inputs, labels


def answer_loss(model, inputs, labels, prefix_ids: list[int] | None = None):
    """Summed cross-entropy of the answer tokens (right padding: pads come after every real token).

    With ``prefix_ids`` (the shared system prompt every row starts with), the prefix runs once
    and its keys and values are repeated for every row: training's own prefix cache.
    """
    if prefix_ids is None:
        logits = model(input_ids=inputs).logits[:, :-1]
        targets = labels[:, 1:]
    else:
        n = len(prefix_ids)
        assert inputs[:, :n].eq(torch.tensor(prefix_ids)).all(), "rows must start with the shared prefix"
        prefix = model(input_ids=inputs[:1, :n], use_cache=True)
        cache = prefix.past_key_values
        cache.batch_repeat_interleave(inputs.shape[0])
        rest = model(input_ids=inputs[:, n:], past_key_values=cache, use_cache=True).logits
        # The prefix's last position predicts the first suffix token, which is never an answer token.
        logits, targets = rest[:, :-1], labels[:, n + 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=-100, reduction="sum"), int((targets != -100).sum())


@torch.no_grad()
def greedy_replies(model, tokenizer, examples: list[chat_tasks.Example], batch_size: int = 64,
                   max_new_tokens: int = 16) -> list[str]:
    """Replies from transformers' ``generate`` (greedy, left padding, stop at <|im_end|>)."""
    tokenizer.padding_side = "left"
    replies = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        prompts = [tokenizer.apply_chat_template(ex.messages(), tokenize=False, add_generation_prompt=True)
                   for ex in chunk]
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens)
        replies += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    return replies


def held_out_accuracy(model, tokenizer, per_task: int) -> dict[str, float]:
    model.eval()
    held_out = [ex for exs in chat_tasks.held_out_set(per_task).values() for ex in exs]
    scores = chat_tasks.accuracy(list(zip(held_out, greedy_replies(model, tokenizer, held_out))))
    model.train()
    return scores


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=chat_tasks.TRAIN_SEED, help="training seed (default: 0)")
    parser.add_argument("--steps", type=int, default=4000, help="optimizer steps (default: 4000)")
    parser.add_argument("--batch-size", type=int, default=64, help="questions per step (default: 64)")
    parser.add_argument("--lr", type=float, default=4e-3, help="peak learning rate (default: 4e-3)")
    parser.add_argument("--vocab-size", type=int, default=512, help="tokenizer vocabulary (default: 512)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default: 1: the matrices are too small to split)")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="continue from this checkpoint (its tokenizer and weights) instead of from scratch")
    parser.add_argument("--task-weights", type=parse_weights, default=TASK_WEIGHTS,
                        help="share of each task, e.g. add=0.4,square=0.1,count=0.2,reverse=0.2,say=0.1 (the default)")
    parser.add_argument("--eval-every", type=int, default=0, help="held-out check every N steps (0: only at end)")
    parser.add_argument("--eval-per-task", type=int, default=100, help="held-out questions per task (default: 100)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be positive")

    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    started = time.monotonic()

    if args.init_from:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.init_from)
        tokenizer.chat_template = CHAT_TEMPLATE
    else:
        tokenizer = train_tokenizer(args.vocab_size)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
        eos_token_id=eos_ids, bos_token_id=None, pad_token_id=pad_id, tie_word_embeddings=False,
        initializer_range=0.02, **ARCHITECTURE)
    if args.init_from:
        model = transformers.LlamaForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
    else:
        model = transformers.LlamaForCausalLM(config)
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = pad_id
    model.generation_config.do_sample = False
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params:,} parameters; system prompt is "
          f"{len(tokenizer(chat_tasks.SYSTEM_PROMPT)['input_ids'])} tokens", flush=True)

    system_prefix = tokenizer(f"<|im_start|>system\n{chat_tasks.SYSTEM_PROMPT}<|im_end|>\n",
                              add_special_tokens=False)["input_ids"]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0}],
                                  lr=args.lr, betas=(0.9, 0.98))
    warmup = max(1, args.steps // 30)
    cosine = lambda step: 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
    schedule = lambda step: min(1.0, (step + 1) / warmup) * cosine(step)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    tasks, weights = list(args.task_weights), list(args.task_weights.values())
    model.train()
    running = 0.0
    for step in range(args.steps):
        drawn = [chat_tasks.make_example(rng.choices(tasks, weights)[0], rng, held_out=False)
                 for _ in range(args.batch_size)]
        # Two padded groups, so short questions are not padded to the system prompt's length.
        groups = [[encode(tokenizer, ex) for ex in drawn if (ex.system is None) == short] for short in (True, False)]
        losses, n_tokens = [], 0
        for group, prefix in zip(groups, (None, system_prefix)):
            if group:
                loss, count = answer_loss(model, *batch_tensors(group, pad_id), prefix)
                losses.append(loss)
                n_tokens += count
        loss = sum(losses) / n_tokens
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        running = 0.98 * running + 0.02 * loss.item() if step else loss.item()
        if (step + 1) % 100 == 0:
            print(f"step {step + 1}/{args.steps} loss {running:.4f} lr {scheduler.get_last_lr()[0]:.2e} "
                  f"{time.monotonic() - started:.0f} s", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            print("  held-out:", held_out_accuracy(model, tokenizer, 30), flush=True)
    train_seconds = time.monotonic() - started

    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    # A class name every transformers version since 4.x resolves (5.x writes its own new name).
    tokenizer_config = args.out / "tokenizer_config.json"
    saved = json.loads(tokenizer_config.read_text())
    for load_option in ("is_local", "local_files_only"):  # written back after loading with --init-from
        saved.pop(load_option, None)
    tokenizer_config.write_text(json.dumps({**saved, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    scores = held_out_accuracy(model, tokenizer, args.eval_per_task)
    report = {"parameters": n_params, "steps": args.steps, "batch_size": args.batch_size, "seed": args.seed,
              "threads": args.threads, "train_seconds": round(train_seconds, 1), "held_out_accuracy": scores,
              "held_out_per_task": args.eval_per_task}
    if args.init_from and (args.init_from / "training_report.json").is_file():
        report["init_from"] = json.loads((args.init_from / "training_report.json").read_text())
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
