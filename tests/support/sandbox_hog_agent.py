"""A hostile agent program that takes all it can (tests/unit/test_sandbox.py): it forks without end,
allocates without end, writes one file without end, and reports how far each went to `hog.json` in
its working directory; then it writes files without end, until it is ended."""

import json
import os
import pathlib
import time

CHUNK = 2**20


def fork_without_end() -> dict:
    children = 0
    try:
        while children < 100_000:
            if os.fork() == 0:
                time.sleep(3600)
                os._exit(0)
            children += 1
    except OSError as error:
        return {"children": children, "error": error.strerror}
    return {"children": children, "error": None}


def allocate_without_end() -> dict:
    held = []
    try:
        while len(held) < 1_000_000:
            held.append(bytearray(16 * CHUNK))
    except MemoryError:
        return {"bytes": 16 * CHUNK * len(held), "error": "MemoryError"}
    return {"bytes": 16 * CHUNK * len(held), "error": None}


def write_without_end() -> dict:
    with open("one-file", "wb") as file:
        try:
            while True:
                file.write(b"x" * CHUNK)
        except OSError as error:
            return {"bytes": file.tell(), "error": error.strerror}


def main() -> None:
    report = {"fork": fork_without_end(), "memory": allocate_without_end(), "file": write_without_end()}
    os.remove("one-file")
    pathlib.Path("hog.json").write_text(json.dumps(report))
    index = 0
    while True:  # many files, each under the file bound: only the disk bound stops this
        try:
            pathlib.Path(f"flood-{index}").write_bytes(b"y" * 4 * CHUNK)
        except OSError:
            pass
        index += 1


if __name__ == "__main__":
    main()
