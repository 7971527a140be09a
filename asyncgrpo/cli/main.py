"""The `asyncgrpo` command: `train`, `report`, `export`, `serve`, `tiny-model`, `demo`."""

from __future__ import annotations

import argparse
import os
import sys

from asyncgrpo.errors import ConfigurationError


def _tiny_model(args: argparse.Namespace) -> int:
    from asyncgrpo.cli.tiny_model import save_tiny_model

    out = save_tiny_model(args.out_dir, arch=args.arch)
    print(f"tiny {args.arch} model and tokenizer written to {out}")
    return 0


def _server_api_key(args: argparse.Namespace) -> str | None:
    """The key `asyncgrpo serve` gives the server: --api-key-file, --generate-api-key (a new one),
    --api-key, or VLLM_API_KEY; None for none. Never printed: only where it is."""
    from asyncgrpo.generation.server_auth import API_KEY_ENV, read_api_key_file, write_new_api_key

    given = [flag for flag in ("api_key_file", "generate_api_key", "api_key") if getattr(args, flag)]
    if len(given) > 1:
        raise ConfigurationError("give one of --api-key-file, --generate-api-key and --api-key")
    if args.api_key_file:
        key, warning = read_api_key_file(args.api_key_file)
        if warning:
            print(f"asyncgrpo serve: warning: {warning}", file=sys.stderr)
        return key
    if args.generate_api_key:
        key = write_new_api_key(args.generate_api_key, dry_run=args.dry_run)
        if args.dry_run:
            print(f"asyncgrpo serve: dry run: a new API key would be written to {args.generate_api_key}")
            return key
        print(
            f"asyncgrpo serve: a new API key is in {args.generate_api_key} (mode 0600); give it to the "
            f"trainer as {API_KEY_ENV}",
            file=sys.stderr,
        )
        return key
    if args.api_key:
        print(
            "asyncgrpo serve: warning: a key on the command line can be read by every user of this machine "
            f"(ps); prefer --api-key-file or {API_KEY_ENV}",
            file=sys.stderr,
        )
        return args.api_key
    return os.environ.get(API_KEY_ENV) or None


def _serve(argv: list[str]) -> int:
    try:
        return _serve_checked(argv)
    except ValueError as error:  # refused before anything starts: say why and how to fix it
        print(f"asyncgrpo serve: {error}", file=sys.stderr)
        return 2


def _serve_checked(argv: list[str]) -> int:
    from asyncgrpo.generation.server import (
        ServerOptions,
        build_command,
        format_command,
        lora_flags_for_run,
        serve_foreground,
    )

    # Parsed without a MODEL positional, which would swallow the value of a vllm flag
    # (`--api-server-count 8`): the model is the first argument, if it is not a flag.
    args, extra = _serve_parser().parse_known_args(argv)
    model = extra.pop(0) if extra and not extra[0].startswith("-") else None
    if args.for_config is not None:
        from asyncgrpo.cli.train_command import run_serve_for

        names = ("port", "host", "max_model_len", "dtype", "max_lora_rank", "max_loras")
        given = {name: getattr(args, name) for name in names} | {
            "model": model,
            "enable_lora": args.enable_lora or None,
            "return_routed_experts": args.moe_routing_replay or None,
            "api_key": _server_api_key(args),
            "insecure_no_api_key": args.insecure_no_api_key or None,
        }
        return run_serve_for(
            args.for_config,
            given,
            args.cpu,
            args.cpu_kv_cache_gib,
            extra,
            dry_run=args.dry_run,
            teacher=args.teacher,
        )
    if args.teacher is not None:
        print("asyncgrpo serve: --teacher ID needs --for CONFIG.yaml (the config holds the teacher's URL)")
        return 2
    if model is None:
        print("asyncgrpo serve: give a MODEL (first, before vllm's flags), or --for CONFIG.yaml")
        return 2
    if args.enable_lora:  # flags not given explicitly come from the run's settings
        derived = lora_flags_for_run(args.lora_rank, args.max_staleness)
        args.max_lora_rank = args.max_lora_rank or derived["max_lora_rank"]
        args.max_loras = args.max_loras or derived["max_loras"]
    options = ServerOptions(
        model=model,
        port=args.port or 8000,
        host=args.host or "127.0.0.1",
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        cpu=True if args.cpu else None,
        cpu_kv_cache_gib=args.cpu_kv_cache_gib,
        return_routed_experts=args.moe_routing_replay,
        extra_args=extra,
        api_key=_server_api_key(args),
        insecure_no_api_key=args.insecure_no_api_key,
    )
    if args.dry_run:
        print(format_command(*build_command(options)))
        return 0
    return serve_foreground(options)


def _demo(args: argparse.Namespace) -> int:
    from asyncgrpo.cli.demo import run_demo

    return run_demo(workdir=args.workdir, seed=args.seed)


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from asyncgrpo.cli.train_command import run_train

    return run_train(args.config, overrides, check_only=args.check)


def _report(args: argparse.Namespace) -> int:
    from asyncgrpo.report.html import write_report

    path = write_report(args.run_dir, tuple(args.reward_range))
    print(f"report written to {path}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from asyncgrpo.cli.export_command import run_export

    return run_export(args.checkpoint, args.out_dir, args.max_file_size)


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--for",
        dest="for_config",
        default=None,
        metavar="CONFIG.yaml",
        help="derive the flags from a training config (its model, dtype, URL, LoRA, top-k/top-p, "
        "token_budget); a MODEL and flags given here win, unknown arguments go to vllm",
    )
    parser.add_argument(
        "--teacher",
        default=None,
        metavar="ID",
        help="with --for: serve the config's teacher ID (teacher_server_urls) instead of the student: its "
        "model from the config's teacher_models or MODEL, its URL's port, the prompt log-probs it reports, "
        "no weight routes",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the command without running it (with --for a config with teachers and no --teacher: "
        "the student's and each teacher's)",
    )
    parser.add_argument("--port", type=int, default=None, help="default 8000, or the config's URL with --for")
    parser.add_argument("--host", default=None, help="default 127.0.0.1, or the config's URL with --for")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int, default=None)
    parser.add_argument("--max-loras", type=int, default=None)
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        help="with --enable-lora: the run's LoraConfig r; --max-lora-rank defaults to the smallest vLLM "
        "value >= it",
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=4,
        help="with --enable-lora: the run's max_staleness (default 4, the trainer's); --max-loras defaults "
        "to it + 2",
    )
    parser.add_argument(
        "--moe-routing-replay",
        action="store_true",
        help="return each token's routed experts (vLLM's --enable-return-routed-experts), for a run with "
        "moe_routing_replay=True; GPU only",
    )
    parser.add_argument("--cpu", action="store_true", help="CPU flags even when a GPU is visible")
    parser.add_argument("--cpu-kv-cache-gib", type=int, default=1)
    # The server's API key: every route but liveness requires it (docs/security.md).
    parser.add_argument(
        "--api-key-file", default=None, metavar="FILE", help="the server's API key, read from FILE"
    )
    parser.add_argument(
        "--generate-api-key",
        default=None,
        metavar="FILE",
        help="a new API key for the server, written to FILE (mode 0600; an existing FILE is refused)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="the server's API key (visible to every user in `ps`: prefer --api-key-file or VLLM_API_KEY)",
    )
    parser.add_argument(
        "--insecure-no-api-key",
        action="store_true",
        help="serve beyond loopback without a key: anyone who reaches the port can steer the server",
    )


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncgrpo serve")
    _add_serve_flags(parser)
    return parser


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
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a Hub id or a local model directory (with --for: replaces the config's model)",
    )
    _add_serve_flags(serve)
    serve.set_defaults(run=_serve)

    train = commands.add_parser(
        "train",
        help="train from a YAML config: asyncgrpo train CONFIG.yaml [--key value ...] (any AsyncGRPOConfig "
        "field)",
    )
    train.add_argument("config")
    train.add_argument("--check", action="store_true", help="validate the config and stop (loads nothing)")
    train.set_defaults(run=_train)

    report = commands.add_parser("report", help="plots, report.html and a diagnosis of a run directory")
    report.add_argument("run_dir")
    report.add_argument(
        "--reward-range",
        nargs=2,
        type=float,
        default=(0.0, 1.0),
        metavar=("LOW", "HIGH"),
        help="the rewards' possible range, to place stuck groups at its top, bottom or middle (default 0 1)",
    )
    report.set_defaults(run=_report)

    export = commands.add_parser(
        "export",
        help="a checkpoint (sharded or full) as a Hugging Face folder for from_pretrained and vllm serve",
    )
    export.add_argument("checkpoint", help="a checkpoint-N directory of a run")
    export.add_argument("out_dir", help="a new (or empty) directory to write the folder to")
    export.add_argument(
        "--max-file-size",
        default=None,
        metavar="SIZE",
        help="the largest safetensors file, and what the export holds in memory at once (default 4GiB)",
    )
    export.set_defaults(run=_export)

    demo = commands.add_parser("demo", help="a real async GRPO run of the tiny model on CPU (make demo)")
    demo.add_argument("--workdir", default=".demo")
    demo.add_argument(
        "--seed", type=int, default=0, help="seeds the warm start, the prompts' order and sampling"
    )
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "serve":
        return _serve((sys.argv[1:] if argv is None else argv)[1:])
    if args.command == "train":
        return _train(args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.run(args)
