"""A worker the launcher gives up for lost says where it was stuck: ``SIGUSR1`` makes a worker
process write every thread's stack to its stderr and go on (``elastic.train.worker``), and
``ProcessJobHandle`` sends it before it kills the worker."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

# the worker's main thread blocked in C code (a sleep here, a collective in the field); another
# thread beside it, as the heartbeat is
_STUCK = """
import sys, threading, time
from elastic.train.worker import stacks_on_sigusr1
stacks_on_sigusr1()
threading.Thread(target=lambda: time.sleep(120), name="beat", daemon=True).start()
print("ready", flush=True)
time.sleep(120)
"""


def test_sigusr1_writes_every_threads_stack_and_the_worker_goes_on(tmp_path) -> None:
    err = tmp_path / "stderr"
    with open(err, "w") as f:
        p = subprocess.Popen([sys.executable, "-c", _STUCK], stdout=subprocess.PIPE, stderr=f, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        # faulthandler's dump: the other threads ("Thread 0x...") first, then "Current thread 0x..." last
        while "Current thread 0x" not in err.read_text():
            assert time.monotonic() < deadline, err.read_text()
            assert p.poll() is None, f"the worker ended ({p.returncode}): {err.read_text()}"
            time.sleep(0.05)
        text = err.read_text()
        assert "Thread 0x" in text  # the other thread too
        assert 'File "<string>", line 7' in text  # the main thread's place: the sleep it is stuck in
        assert p.poll() is None  # it goes on
    finally:
        p.kill()
        p.wait(10)
