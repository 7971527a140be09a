"""The weight-sync test's agent (tests/integration/test_harness_e2e.py), an OpenAI-API agent of two model
calls. In mode "span" it waits between them until the test lets it go (a file `go` in the folder
SPAN_SIGNALS names), after saying its first call is done (a file named after its episode there): the
test lets it go once the trainer has synced new weights, so its two turns are sampled by two policy
versions."""

import json
import os
import pathlib
import time

from openai import OpenAI

# How often the waiting agent looks for the go file: its own polling, not a bound of the test's.
POLL_S = 0.05


def main() -> None:
    task = json.loads(pathlib.Path("task.json").read_text())
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    model = os.environ["OPENAI_MODEL"]
    messages = list(task["prompt"])
    first = client.chat.completions.create(model=model, messages=messages)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        task["prompt"][-1],  # the same question again
    ]
    if task.get("mode") == "span":
        signals = pathlib.Path(os.environ["SPAN_SIGNALS"])
        (signals / f"{task['episode_id']}.first").write_text("")
        while not (signals / "go").exists():
            time.sleep(POLL_S)
    second = client.chat.completions.create(model=model, messages=messages)
    pathlib.Path("answer.txt").write_text(second.choices[0].message.content or "")


if __name__ == "__main__":
    main()
