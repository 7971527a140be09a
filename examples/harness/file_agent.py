"""A small agent program, written as any OpenAI-API agent is: it reads its task from task.json, asks
the model in a loop and runs the `write_file` tool the model calls (writing in its working
directory). A reply without a tool call is a draft: the agent saves it to answer.txt itself and asks
the model to review it once; it stops after MAX_TURNS turns. It knows nothing of training: the
trainer points OPENAI_BASE_URL at its capture proxy.

The dataset row may set "mode" to make it misbehave (the tests' fault cases): "crash" exits with an
error after one call, "hang" never returns after one call, "silent" exits without calling the model.
"""

import json
import os
import pathlib
import sys
import threading

from openai import OpenAI

MAX_TURNS = 2

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file in the working directory.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "The file's name."},
                    "text": {"type": "string", "description": "What to write."},
                },
                "required": ["path", "text"],
            },
        },
    }
]


def write_file(path: str, text: str) -> str:
    target = pathlib.Path.cwd() / pathlib.Path(path).name  # never outside the working directory
    target.write_text(text)
    return f"wrote {len(text)} characters to {target.name}"


def main() -> int:
    task = json.loads(pathlib.Path("task.json").read_text())
    mode = task.get("mode", "ok")
    if mode == "silent":
        return 0
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    messages = list(task["prompt"])
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=os.environ["OPENAI_MODEL"], messages=messages, tools=TOOLS
        )
        message = reply.choices[0].message
        if mode == "crash":
            raise RuntimeError("the agent crashed on purpose")
        if mode == "hang":
            threading.Event().wait()
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            # No tool call: the agent keeps the draft itself and asks for one review.
            pathlib.Path("answer.txt").write_text(message.content or "")
            messages.append({"role": "user", "content": "Saved to answer.txt. Improve it if you can."})
            continue
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
                result = write_file(**arguments) if call.function.name == "write_file" else "unknown tool"
            except (TypeError, ValueError) as error:
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
