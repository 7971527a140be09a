"""An agent for the capture proxy's size cap (tests/integration/test_harness_e2e.py), written with the
`openai` package. The agent of a run that claims the file `claim` in $HUGE_CLAIMS first sends a request whose
history carries a 50 MB tool output and writes the status and message it got back to `refused.json`
there; every agent, that one after its refusal, then asks the model once with its task's prompt."""

import json
import os
import pathlib

from openai import APIStatusError, OpenAI

HUGE_TOOL_OUTPUT_BYTES = 50 * 10**6


def claimed(folder: pathlib.Path) -> bool:
    try:
        os.close(os.open(folder / "claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def main() -> None:
    task = json.loads(pathlib.Path("task.json").read_text())
    folder = pathlib.Path(os.environ["HUGE_CLAIMS"])
    client, model = OpenAI(max_retries=0), os.environ["OPENAI_MODEL"]
    prompt = list(task["prompt"])
    if claimed(folder):
        call = {"id": "c0", "type": "function", "function": {"name": "read_log", "arguments": "{}"}}
        history = prompt + [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c0", "content": "x" * HUGE_TOOL_OUTPUT_BYTES},
        ]
        try:
            client.chat.completions.create(model=model, messages=history)
            outcome = {"status": 200}
        except APIStatusError as error:
            outcome = {"status": error.status_code, "message": error.message}
        (folder / "refused.json").write_text(json.dumps(outcome))
    client.chat.completions.create(model=model, messages=prompt)


if __name__ == "__main__":
    main()
