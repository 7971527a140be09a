"""Measured figures live in bench/RESULTS.md and docs/, not in the package's comments, docstrings or
strings: a timing or a speedup quoted next to the code goes stale the day the code or the machine
changes, while the code's reasons stay true. The code keeps the reason and points to the page."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What a measurement looks like: a time in ms or us, a bandwidth or FLOP rate, a rate in tokens (or
# completions, samples, steps) per second, an MFU, an "Nx faster" or "N% slower", an approximate
# number of seconds. Thresholds the code uses (0.8 of the KV cache, a 2x drop) do not look like this.
MEASURED_FIGURE = re.compile(
    r"\d+(\.\d+)? ?(ms|us|µs|[KMGT]B/s|[GT]FLOP/s|[GT]FLOPS)\b"
    r"|\d+(\.\d+)?%? ?(-|to) ?\d+(\.\d+)?% ?MFU|\d+(\.\d+)? ?% ?(of )?(MFU|peak)\b|\bMFU (of|at) \d"
    r"|\d+(\.\d+)? ?x (faster|slower|speedup|quicker|the speed)"
    r"|\d+(\.\d+)? ?% (faster|slower|quicker|more throughput)|\d+(\.\d+)? ?% (more|less|fewer) than\b"
    r"|\b(faster|slower) by \d"
    r"|\d[\d,.]*k? ?([a-z]+ )?(tokens?|tok|completions|samples|steps|requests)(/s| per second)\b"
    r"|~\d+(\.\d+)? ?(s|seconds?|minutes?)\b"
    r"|\d+(\.\d+)? ?s (per|a) step\b",
    flags=re.IGNORECASE,
)

_TEXT_TOKENS = {tokenize.COMMENT, tokenize.STRING} | (
    {tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE") else set()
)


def _text_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of each physical line of the comments and strings of `source`."""
    lines = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in _TEXT_TOKENS:
            for index, text in enumerate(token.string.splitlines()):
                lines.append((token.start[0] + index, text.strip().lstrip("#").strip()))
    return lines


def measured_figures(source: str) -> list[tuple[int, str]]:
    """(line, matched text) of every measured-looking figure in the comments and strings of `source`,
    also one that a line break splits ("16.5" at the end of a line, "ms" at the start of the next)."""
    lines = _text_lines(source)
    found = [(number, match.group(0)) for number, text in lines for match in MEASURED_FIGURE.finditer(text)]
    for (number, text), (_, following) in zip(lines, lines[1:]):
        joined = f"{text} {following}"
        found += [
            (number, match.group(0))
            for match in MEASURED_FIGURE.finditer(joined)
            if match.start() < len(text) < match.end()
        ]
    return sorted(found)


def test_no_measured_figures_in_the_package_comments_docstrings_or_strings():
    sources = sorted((ROOT / "asyncgrpo").rglob("*.py"))
    assert len(sources) > 50
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {text!r}"
        for path in sources
        for line, text in measured_figures(path.read_text())
    ]
    assert not offenders, (
        "measured figures in asyncgrpo/ (move them to bench/RESULTS.md or docs/ and point there): "
        f"{offenders}"
    )


def test_the_check_finds_planted_figures_and_leaves_thresholds_alone():
    planted = '''
"""Docstring: torch's fused AdamW moved them at 2.9 TB/s on an H200 (16.5
ms)."""
X = 1  # fwd+bwd went from 32-35% to 47-50% MFU
HELP = "Compile each layer (~1.4x faster fwd+bwd)"
Y = 2  # a 10 us reward waited ~100 ms for its turn; the server starts in ~45 s
Z = 3  # 3% faster tree attention; 721 completions/s; 2,440 tokens/s; ~2-3k generated tokens/s
W = 4  # a 16k-token row kept 8% more than the estimate
'''
    found = [text for _, text in measured_figures(planted)]
    for figure in ("2.9 TB/s", "16.5 ms", "47-50% MFU", "1.4x faster", "10 us", "100 ms", "~45 s"):
        assert any(figure in text for text in found), (figure, found)
    assert any("3% faster" in text for text in found) and any("completions/s" in text for text in found)
    assert any("2,440 tokens/s" in text for text in found) and any("3k generated" in text for text in found)
    assert any("8% more than" in text for text in found)
    # reported at their own line; "16.5 / ms", split by a line break, at the line where it starts
    assert {line for line, _ in measured_figures(planted)} == {2, 4, 5, 6, 7, 8}

    rules = """
CAP = 0.8  # above 80% KV usage the cap drops by 30%; 8 rollouts: 8x generation per prompt
HELP = "0.5: tolerate a 2x drop. Timeout in seconds (default 600 s), checked every 5 s."
MS = 1000 * elapsed  # ms
print(f"{seconds:.1f} s, {rate:.0%} of the step, {ms:.2f} ms")
"""
    assert measured_figures(rules) == []
