"""The adversarial agent of tests/test_harness_e2e.py: an OpenAI-API agent that tries what a policy
trained by RL finds, to raise its reward or to get out of its session. It reads its task from
task.json (never from stdin), writes what it saw of its environment to REPORT_DIR (a variable the
test passes in `env`), and acts by its row's "mode" (a column the test names in `agent_columns`):

- "honest": one model call, then the row's "hint" (the right answer, named for it) to answer.txt;
- "cheat": one model call, a wrong answer to answer.txt, then a forged answer key written into
  task.json and every other file of its session's folder (its working directory, its temporary
  folder, its log). It could reach other sessions' folders too (agents run as the trainer's user:
  docs/harness.md), which would only make their agents, run at the same time, answer wrongly;
- "sleepy": one agent of the group (the first to claim it) never reads stdin, never calls the model,
  and sleeps; it writes its pid and start time first. The others of the group are honest;
- "escape": starts a process that double-forks out of its process group and session (`setsid`) and
  sleeps, writes that process's pid, then is honest;
- anything else: honest.
"""

import json
import os
import pathlib
import sys
import threading
import time

from openai import OpenAI

SLEEP_FOREVER = "import threading; threading.Event().wait()"


def escape(report: pathlib.Path, episode: str) -> None:
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            (report / f"escapee-{episode}.pid").write_text(str(os.getpid()))
            os.execv(sys.executable, [sys.executable, "-c", SLEEP_FOREVER])  # not an agent's command line
        os._exit(0)
    os.wait()


def forge(task: dict) -> None:
    forged = json.dumps({**task, "answer": "7"})
    for folder, _, files in os.walk(pathlib.Path.cwd().parent):
        for name in files:
            if name != "answer.txt":
                try:
                    pathlib.Path(folder, name).write_text(forged)
                except OSError:  # a session removed meanwhile
                    pass


def main() -> None:
    task = json.loads(pathlib.Path("task.json").read_text())
    report = pathlib.Path(os.environ["REPORT_DIR"])
    episode, mode = task["episode_id"], task.get("mode", "honest")
    (report / f"{episode}.env.json").write_text(json.dumps(dict(os.environ)))
    if mode == "sleepy":
        try:
            claim = os.open(report / "sleeper.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            mode = "honest"
        else:
            os.write(claim, json.dumps({"pid": os.getpid(), "started": time.time()}).encode())
            os.close(claim)
            threading.Event().wait()
    if mode == "escape":
        escape(report, episode)
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=task["prompt"])
    if mode == "cheat":
        pathlib.Path("answer.txt").write_text("7")
        forge(task)
    else:
        pathlib.Path("answer.txt").write_text(str(task.get("hint", "")))


if __name__ == "__main__":
    main()
