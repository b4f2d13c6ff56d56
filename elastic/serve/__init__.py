"""Reference inference replica and load generator.

* ``python -m elastic.serve``: a small GPT on CPU behind an OpenAI-compatible subset
  (``POST /v1/completions``), a bounded running batch and waiting queue, vLLM-named
  metrics on ``/metrics`` (``server.py``, ``engine.py``, ``gpt.py``).
* ``elastic.serve.ray_replica``: the same server inside a Ray actor (``num_gpus=1``).
* ``python -m elastic.serve.loadgen``: open-loop Poisson load following a rate profile.
* ``elastic.serve.profiles``: pure rate profiles (diurnal, bursts, CSV) for everyone.

This package's ``__init__`` imports nothing heavy so that ``profiles`` stays importable
from pure code (the simulator) without torch, FastAPI or httpx.
"""
