"""Run by tests/train/test_warm.py as ``python -m tests.train._warm_child OUT [ACTION]``: writes what
the process sees to OUT (JSON), then does ACTION (``exit:N``, ``raise``, ``sleep``, ``torch``, ``finish``)."""

import json
import os
import random
import sys
import time

out, action = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
seen = {"env": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv, "pid": os.getpid(),
        "sid": os.getsid(0), "comm": open("/proc/self/comm").read().strip(), "random": random.random(), "name": __name__}
if action == "torch":
    import torch

    seen["threads"] = torch.get_num_threads()
    seen["sum"] = float(torch.arange(10, dtype=torch.float64).sum())
with open(out + ".tmp", "w") as f:
    json.dump(seen, f)
os.replace(out + ".tmp", out)
print("child says hello", flush=True)
if action.startswith("exit:"):
    sys.exit(int(action[5:]))
if action == "raise":
    raise RuntimeError("child failed on purpose")
if action == "sleep":
    time.sleep(120)
if action == "finish":  # ends as an interpreter does: non-daemon threads joined, then atexit handlers
    import atexit
    import threading

    def late() -> None:
        time.sleep(0.2)
        with open(out + ".thread", "w") as f:
            f.write("done")

    atexit.register(lambda: open(out + ".atexit", "w").write(str(os.path.exists(out + ".thread"))))
    threading.Thread(target=late).start()
