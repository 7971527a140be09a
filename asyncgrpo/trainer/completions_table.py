"""`log_completions`: a table of recent completions with their rewards at each logging step."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from asyncgrpo.sample import Sample


def print_completions(samples: list[Sample], tokenizer, step: int) -> None:
    if not samples:
        return
    table = Table(title=f"completions at step {step}", show_lines=True)
    table.add_column("prompt", overflow="fold", max_width=50)
    table.add_column("completion", overflow="fold", max_width=70)
    table.add_column("reward", justify="right")
    table.add_column("advantage", justify="right")
    for sample in samples:
        first_trained = int(sample.trained.argmax())
        prompt = tokenizer.decode(sample.token_ids[:first_trained], skip_special_tokens=True)
        completion = tokenizer.decode(sample.token_ids[first_trained:], skip_special_tokens=True)
        table.add_row(prompt[-200:], completion[:400], f"{sample.reward:.3f}", f"{sample.advantage:+.3f}")
    Console().print(table)
