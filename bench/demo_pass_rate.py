"""How dependable `make demo` is: run it with several seeds, one after another, and count the passes
(the reward up by at least +0.3 within 10 minutes).

    .venv/bin/python bench/demo_pass_rate.py --runs 10 [--first-seed 0]

Each run is the real demo (its own vLLM CPU server, warm start, async GRPO); a run takes 4-7 minutes
on the 2-core machine, so ten take about an hour. Prints one line per run and, last,
`demo_pass_rate passed=P runs=N saturated=S target=0.9` (S: the runs that ended before their last step
at a pass over the prompts without signal).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time

RESULT = re.compile(r"demo reward_first10=(\S+) reward_last10=(\S+) .*steps=(\S+) minutes=(\S+)")
# The trainer's warning when a pass over the prompts brought nothing to train after it had trained: the
# run ended there (docs/reliability.md, "A pass without signal").
SATURATED = "brought nothing to train"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args()
    passed = saturated = 0
    for seed in range(args.first_seed, args.first_seed + args.runs):
        started = time.time()
        with tempfile.TemporaryDirectory(prefix="demo-") as workdir:
            run = subprocess.run(
                [sys.executable, "-m", "asyncgrpo.cli", "demo", "--seed", str(seed), "--workdir", workdir],
                capture_output=True,
                text=True,
            )
        found = RESULT.search(run.stdout)
        figures = "first10=%s last10=%s steps=%s minutes=%s" % found.groups() if found else "no result line"
        if SATURATED in run.stderr:
            figures += " saturated"
        saturated += SATURATED in run.stderr
        reasons = [line for line in run.stdout.splitlines() if "FAILED" in line]
        if run.returncode != 0 and not reasons:
            reasons = run.stderr.strip().splitlines()[-3:]
        passed += run.returncode == 0
        verdict = "pass" if run.returncode == 0 else "FAIL " + " | ".join(reasons)[:300]
        print(f"seed={seed} {figures} wall={time.time() - started:.0f}s {verdict}", flush=True)
    print(f"demo_pass_rate passed={passed} runs={args.runs} saturated={saturated} target=0.9")
    return 0


if __name__ == "__main__":
    sys.exit(main())
