"""The `asyncgrpo` command: `tiny-model`, `serve`, `demo`."""

from __future__ import annotations

import argparse
import sys


def _tiny_model(args: argparse.Namespace) -> int:
    from asyncgrpo.tiny_model import save_tiny_model

    out = save_tiny_model(args.out_dir, arch=args.arch)
    print(f"tiny {args.arch} model and tokenizer written to {out}")
    return 0


def _serve(args: argparse.Namespace, extra: list[str]) -> int:
    from asyncgrpo.generation.server import ServerOptions, serve_foreground

    options = ServerOptions(
        model=args.model,
        port=args.port,
        host=args.host,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        cpu=True if args.cpu else None,
        cpu_kv_cache_gib=args.cpu_kv_cache_gib,
        extra_args=extra,
    )
    return serve_foreground(options)


def _demo(args: argparse.Namespace) -> int:
    from asyncgrpo.demo import run_demo

    return run_demo(workdir=args.workdir, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncgrpo", description="Asynchronous GRPO against a vLLM server.")
    commands = parser.add_subparsers(dest="command", required=True)

    tiny = commands.add_parser("tiny-model", help="build a tiny offline model (tests, benchmarks, the demo)")
    tiny.add_argument("out_dir")
    tiny.add_argument(
        "--arch",
        default="qwen3",
        choices=["qwen3", "qwen3_5", "qwen3_5_vl", "qwen3_moe"],
        help="family: dense Qwen3, Qwen3.5 (Gated DeltaNet hybrid), its image-text-to-text checkpoint "
        "form, or Qwen3-MoE",
    )
    tiny.set_defaults(run=_tiny_model)

    serve = commands.add_parser(
        "serve",
        help="start `vllm serve` with the flags the trainer needs (unknown arguments go to vllm)",
    )
    serve.add_argument("model")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--dtype", default=None)
    serve.add_argument("--enable-lora", action="store_true")
    serve.add_argument("--max-lora-rank", type=int, default=None)
    serve.add_argument("--max-loras", type=int, default=None)
    serve.add_argument("--cpu", action="store_true", help="CPU flags even when a GPU is visible")
    serve.add_argument("--cpu-kv-cache-gib", type=int, default=1)
    serve.set_defaults(run=_serve)

    demo = commands.add_parser("demo", help="a real async GRPO run of the tiny model on CPU (make demo)")
    demo.add_argument("--workdir", default=".demo")
    demo.add_argument("--seed", type=int, default=0, help="seeds the warm start, the prompts' order and sampling")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "serve":
        return _serve(args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
