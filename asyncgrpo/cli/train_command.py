"""`asyncgrpo train CONFIG.yaml` and `asyncgrpo serve --for CONFIG.yaml`."""

from __future__ import annotations

import logging
import signal
import sys
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
    host, port = _listen_address(args.vllm_server_urls[0] if args.vllm_server_urls else None, 8000)
    extra = []
    if args.top_p < 1 or args.top_k > 0 or (args.min_p or 0) > 0:
        extra.append("--return-sampling-mask")  # the candidate set the trainer renormalizes over
    options = ServerOptions(
        model=run.model,
        port=port,
        host=host,
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


def teacher_server_options(
    run: RunConfig, teacher_id: str, model: str | None = None, cpu: bool | None = None
):
    """The `vllm serve` flags of the run's teacher `teacher_id`: its model (`model`, else the config's
    teacher_models), host and port from its URL in teacher_server_urls, prompt log-probs up to
    teacher_top_k plus the realized token (`--max-logprobs`), room for a sample and the one token a
    scoring request generates, and no weight routes: a teacher is never sent weights."""
    from asyncgrpo.generation.server import ServerOptions

    args = run.args
    urls = args.teacher_server_urls or {}
    if teacher_id not in urls:
        raise ConfigurationError(
            f"--teacher {teacher_id}: the config has no such teacher (teacher_server_urls: "
            f"{', '.join(urls) or 'none'})"
        )
    model = model or run.teacher_models.get(teacher_id)
    if model is None:
        raise ConfigurationError(
            f"teacher {teacher_id!r} has no model: set `teacher_models: {{{teacher_id}: MODEL}}` in the "
            f"config, or give it: asyncgrpo serve --for CONFIG.yaml --teacher {teacher_id} MODEL"
        )
    host, port = _listen_address(urls[teacher_id], None)
    budget = args.token_budget if (args.token_budget or 0) > 0 else None
    return ServerOptions(
        model=model,
        port=port,
        host=host,
        max_model_len=None if budget is None else budget + 1,  # a sample, plus the one token generated
        cpu=cpu,
        receives_weights=False,
        extra_args=["--max-logprobs", str(args.teacher_top_k + 1)],
    )


def _listen_address(url: str | None, default_port: int | None) -> tuple[str, int]:
    """(host, port) a server reached at `url` listens on; without a port in the URL, `default_port`, or
    the scheme's when None."""
    parsed = urlparse(url or f"http://localhost:{default_port}")
    scheme_port = 443 if parsed.scheme == "https" else 80
    return parsed.hostname or "127.0.0.1", parsed.port or default_port or scheme_port


# Settings typed on the command line that hold for every server of a dry run's listing; the others (the
# model, the port, vLLM's flags...) are the one served server's.
SHARED_GIVEN = ("api_key", "insecure_no_api_key")


def run_serve_for(
    config_path: str,
    given: dict,
    cpu: bool,
    cpu_kv_cache_gib: int,
    extra: list[str],
    dry_run: bool = False,
    teacher: str | None = None,
) -> int:
    """`asyncgrpo serve --for CONFIG [MODEL] [--teacher ID]`: flags from the config, for the student's
    server or, with `teacher`, that teacher's; `given` (the model, port, host, max_model_len, dtype...
    typed on the command line, None when not) win over them. A dry run without `teacher` lists the
    student's command and each teacher's."""
    from asyncgrpo.generation.server import build_command, format_command, serve_foreground

    try:
        run = build_run_config(read_config(config_path))
        if teacher is None:
            options = server_options_for(run, cpu=True if cpu else None)
        else:
            options = teacher_server_options(run, teacher, given.get("model"), cpu=True if cpu else None)
    except ConfigurationError as error:
        print(f"asyncgrpo serve --for: {config_path}: {error}")
        return 2
    for name, value in given.items():
        if value is not None:
            setattr(options, name, value)
    options.cpu_kv_cache_gib = cpu_kv_cache_gib
    options.extra_args += extra
    teachers = list(run.args.teacher_server_urls or {}) if teacher is None else []
    if dry_run:
        if teachers:
            print("# the student's server (sent weights)")
        print(format_command(*build_command(options)))
        for teacher_id in teachers:
            print(_teacher_listing(run, config_path, teacher_id, options))
        return 0
    if teachers:
        print(
            f"asyncgrpo serve: {config_path} has teachers ({', '.join(teachers)}): serve each with "
            f"asyncgrpo serve --for {config_path} --teacher ID",
            file=sys.stderr,
        )
    print(f"serving for {config_path}{f' (teacher {teacher})' if teacher else ''}:", flush=True)
    return serve_foreground(options)  # prints the command it runs


def _teacher_listing(run: RunConfig, config_path: str, teacher_id: str, student) -> str:
    """A dry run's lines for one teacher: what it is, and its command (with the student's shared
    settings: CPU, KV space, API key), or how to give its model."""
    from asyncgrpo.generation.server import build_command, format_command

    url = run.args.teacher_server_urls[teacher_id]
    heading = f"# teacher {teacher_id!r} at {url} (never sent weights)"
    if teacher_id not in run.teacher_models:
        return (
            f"{heading}: its model is not in the config; serve it with\n"
            f"#   asyncgrpo serve --for {config_path} --teacher {teacher_id} MODEL"
        )
    options = teacher_server_options(run, teacher_id, cpu=student.cpu)
    options.cpu_kv_cache_gib = student.cpu_kv_cache_gib
    for name in SHARED_GIVEN:
        setattr(options, name, getattr(student, name))
    return f"{heading}\n{format_command(*build_command(options))}"
