"""The adversarial agent of tests/integration/test_harness_e2e.py: an OpenAI-API agent that tries what a
policy trained by RL finds, to raise its reward, to steal, or to get out of its session. It reads its task
from task.json (never from stdin), writes what it saw to REPORT_DIR (a variable the test passes in
`env`, a path it names in `agent_writable_paths`), and acts by its row's "mode" (a column the test
names in `agent_columns`):

- "honest": one model call, then the row's "hint" (the right answer, named for it) to answer.txt;
- "cheat": one model call, a wrong answer to answer.txt, then a forged answer key written into
  task.json and every other file it can reach of its session;
- "spy": looks for the trainer's secrets in every process's environment, for its row's answer by
  following every process's working directory and open files to the training data, for the Hub
  token under every HOME it learns, and for every listening port of 127.0.0.1
  (tests/support/sandbox_spy_agent.py, which the test lets it read); reports its findings, then one model
  call and the answer it found (or none);
- "hog": forks, allocates and writes one file without end (tests/support/sandbox_hog_agent.py), reports how
  far each went, makes its model call, then writes files without end until the sandbox ends it;
- "sleepy": one agent of the group (the first to claim it) never reads stdin, never calls the model,
  and sleeps; it writes its pid (its namespace's) and start time first. The others are honest;
- "escape": starts a process that double-forks out of its process group and session (`setsid`) and
  sleeps, with ESCAPEE_MARK on its command line, then is honest;
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
ESCAPEE_MARK = "asyncgrpo-test-escapee"


def escape(report: pathlib.Path, episode: str) -> None:
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            (report / f"escapee-{episode}.pid").write_text(str(os.getpid()))
            os.execv(sys.executable, [sys.executable, "-c", SLEEP_FOREVER, ESCAPEE_MARK])
        os._exit(0)
    os.wait()


def forge(task: dict) -> None:
    forged = json.dumps({**task, "answer": "7"})
    for folder, _, files in os.walk(pathlib.Path.cwd().parent):
        for name in files:
            if name != "answer.txt":
                try:
                    pathlib.Path(folder, name).write_text(forged)
                except OSError:  # out of its reach, or a session removed meanwhile
                    pass


def spy(task: dict, report: pathlib.Path, episode: str) -> str:
    """What the spy found, reported; the answer it found, or "none"."""
    import sandbox_spy_agent as tools  # beside this script (the test lets the sandbox read it)

    prompt = task["prompt"][-1]["content"]
    found = {"secrets": [], "tokens": [], "data": [], "ports": [], "processes": len(tools.processes())}
    homes = tools.environments(found, json.loads(os.environ["PLANTED_SECRETS"]))  # the values to look for
    tools.data_files(found, prompt)
    tools.tokens(found, homes)
    tools.ports(found)
    (report / f"{episode}.spy.json").write_text(json.dumps(found))
    return found["data"][0]["answer"] if found["data"] else "none"


def hog(report: pathlib.Path, episode: str) -> None:
    import sandbox_hog_agent as tools

    taken = {"fork": tools.fork_without_end(), "memory": tools.allocate_without_end()}
    taken["file"] = tools.write_without_end()
    os.remove("one-file")
    (report / f"{episode}.hog.json").write_text(json.dumps(taken))


def flood() -> None:
    index = 0
    while True:
        try:
            pathlib.Path(f"flood-{index}").write_bytes(b"y" * 2**22)
        except OSError:
            pass
        index += 1


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
    answer = str(task.get("hint", ""))
    if mode == "spy":
        answer = spy(task, report, episode)
    if mode == "hog":
        hog(report, episode)
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=task["prompt"])
    if mode == "cheat":
        pathlib.Path("answer.txt").write_text("7")
        forge(task)
    else:
        pathlib.Path("answer.txt").write_text(answer)
    if mode == "hog":
        flood()


if __name__ == "__main__":
    main()
