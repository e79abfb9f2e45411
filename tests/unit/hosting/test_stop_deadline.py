"""A stopped ``lmhead serve`` ends within its grace whatever still runs: the last resort, in a
process of its own whose main thread has returned while a thread that never ends holds the
interpreter's exit (what a run that never ended did, issue 43)."""

from __future__ import annotations

import subprocess
import sys
import time

from service.hosting.server import FORCED_EXIT_STATUS

HELD = """
import threading
from service.hosting.server import exit_after

threading.Thread(target=threading.Event().wait, name="a run that never ends").start()
exit_after(0.5)
"""


def test_a_process_held_by_a_thread_exits_at_the_deadline() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", HELD], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == FORCED_EXIT_STATUS, done.stderr
    assert time.monotonic() - started < 10
    assert "did not stop within 0.5 s of the stop signal: exiting now" in done.stderr
