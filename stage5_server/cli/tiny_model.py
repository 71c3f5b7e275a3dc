"""``stagedserve make-tiny-model DIR``: a random-weight Hugging Face checkpoint for tests.

    stagedserve make-tiny-model DIR --arch {llama,qwen2,qwen3,llava} [--seed N] [--size {tiny,small,qwen3-0.6b}]
"""

from __future__ import annotations

import argparse


def add_make_tiny_model_subcommand(subparsers) -> None:
    p = subparsers.add_parser("make-tiny-model", help="write a tiny random-weight checkpoint (for tests)")
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--arch", choices=("llama", "qwen2", "qwen3", "llava"), default="llama",
                   help="llava: a vision-language model (CLIP tower, Llama decoder) with its processor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", choices=("tiny", "small", "qwen3-0.6b"), default="tiny")
    p.set_defaults(func=make_tiny_model)


def make_tiny_model(args: argparse.Namespace) -> int:
    from course.tiny_model import SIZES  # the course's builders (no engine needs them)
    from course.tiny_model import make_tiny_model as make

    if args.arch == "llava":
        from course.tiny_llava import make_tiny_llava

        print(make_tiny_llava(args.dir, seed=args.seed, size=SIZES[args.size]))
    else:
        print(make(args.dir, arch=args.arch, seed=args.seed, size=SIZES[args.size]))
    return 0
