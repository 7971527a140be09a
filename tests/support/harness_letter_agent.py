"""The learning test's agent (tests/integration/test_harness_learning.py), written as any OpenAI-API agent is:
it reads its task from task.json, asks the model once, and saves the reply to answer.txt itself (its
own action on its working directory, which `verify` then reads). The model is offered no tool
schema: the prompt stays a few tokens long, so a short supervised warm start covers it (the tool
path of the capture is tested by test_harness_e2e.py)."""

import json
import os
import pathlib

from openai import OpenAI


def main() -> None:
    task = json.loads(pathlib.Path("task.json").read_text())
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=task["prompt"])
    pathlib.Path("answer.txt").write_text(reply.choices[0].message.content or "")


if __name__ == "__main__":
    main()
