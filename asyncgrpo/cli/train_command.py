"""`asyncgrpo train CONFIG.yaml` and `asyncgrpo serve --for CONFIG.yaml`."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from urllib.parse import urlparse

from asyncgrpo.cli.run_config import RunConfig, build_run_config, build_trainer, read_config
from asyncgrpo.errors import ConfigurationError
from asyncgrpo.generation.server import lora_flags_for_run
from asyncgrpo.run.redaction import redact_config

RESOLVED_CONFIG_FILE = "config.yaml"


def run_train(config_path: str, overrides: list[str], check_only: bool = False) -> int:
    try:
        run = build_run_config(read_config(config_path, overrides))
    except ConfigurationError as error:
        print(f"asyncgrpo train: {config_path}: {error}")
        return 2
    if check_only:
        print(f"{config_path}: valid (model {run.model}, output_dir {run.args.output_dir})")
        return 0
    logging.basicConfig(level=logging.WARNING)
    # SIGTERM (a timeout, `kill`) unwinds like Ctrl-C: the rollout worker is stopped, not orphaned.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    trainer = build_trainer(run)
    write_resolved_config(run)
    trainer.train(resume_from_checkpoint=run.raw.get("resume_from_checkpoint"))
    print(f"run directory: {run.args.output_dir} (asyncgrpo report {run.args.output_dir})")
    return 0


def write_resolved_config(run: RunConfig) -> Path:
    """The config as run (file plus overrides) beside config.json (every AsyncGRPOConfig field), with
    secrets redacted (a harness `env`'s values, secret-named keys)."""
    import yaml

    directory = Path(run.args.output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RESOLVED_CONFIG_FILE
    path.write_text(yaml.safe_dump(redact_config(run.raw), sort_keys=False))
    return path


def server_options_for(run: RunConfig, cpu: bool | None = None):
    """The `vllm serve` flags the run needs: its model, dtype, port, LoRA slots and rank, the
    candidate sets of top-k/top-p, the routed experts of MoE routing replay, and a max model length
    (token_budget when set)."""
    from asyncgrpo.generation.server import ServerOptions

    args = run.args
    url = urlparse(args.vllm_server_urls[0] if args.vllm_server_urls else "http://localhost:8000")
    extra = []
    if args.top_p < 1 or args.top_k > 0 or (args.min_p or 0) > 0:
        extra.append("--return-sampling-mask")  # the candidate set the trainer renormalizes over
    options = ServerOptions(
        model=run.model,
        port=url.port or 8000,
        host=url.hostname or "127.0.0.1",
        max_model_len=args.token_budget if (args.token_budget or 0) > 0 else None,  # <= 0: no budget
        dtype=None if args.dtype == "auto" else args.dtype,
        cpu=cpu,
        return_routed_experts=args.moe_routing_replay,
        extra_args=extra,
    )
    if run.peft_config is not None:
        try:
            flags = lora_flags_for_run(int(run.peft_config.get("r", 8)), args.max_staleness)
        except ValueError as error:
            raise ConfigurationError(f"peft_config: {error}") from None
        options.enable_lora, options.max_lora_rank, options.max_loras = (
            True,
            flags["max_lora_rank"],
            flags["max_loras"],
        )
    return options


def run_serve_for(
    config_path: str, given: dict, cpu: bool, cpu_kv_cache_gib: int, extra: list[str], dry_run: bool = False
) -> int:
    """`asyncgrpo serve --for CONFIG [MODEL]`: flags from the config; `given` (the model, port, host,
    max_model_len, dtype... typed on the command line, None when not) win over them."""
    from asyncgrpo.generation.server import build_command, format_command, serve_foreground

    try:
        run = build_run_config(read_config(config_path))
        options = server_options_for(run, cpu=True if cpu else None)
    except ConfigurationError as error:
        print(f"asyncgrpo serve --for: {config_path}: {error}")
        return 2
    for name, value in given.items():
        if value is not None:
            setattr(options, name, value)
    options.cpu_kv_cache_gib = cpu_kv_cache_gib
    options.extra_args += extra
    if dry_run:
        print(format_command(*build_command(options)))
        return 0
    print(f"serving for {config_path}:", flush=True)
    return serve_foreground(options)  # prints the command it runs
