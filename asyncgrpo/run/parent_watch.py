"""Helper processes (the rollout worker, reward verifiers) that end when the process that started
them is gone, instead of living on as orphans."""

from __future__ import annotations

import os
import threading
import time

PARENT_WATCH_INTERVAL_S = 0.5


def exit_when_parent_dies(parent_pid: int) -> None:
    """A daemon thread that ends this process as soon as `parent_pid` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_WATCH_INTERVAL_S)
        os._exit(1)

    threading.Thread(target=watch, name="asyncgrpo-parent-watch", daemon=True).start()
