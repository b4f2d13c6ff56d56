"""``python -m elastic.serve``: run one reference replica as a plain process.

Prints ``elastic-serve listening on http://HOST:PORT`` once the socket is bound (port 0
picks a free port; a parent process reads the URL from that line).
"""

from __future__ import annotations

import argparse
import sys

from elastic.model import MODEL_PRESETS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m elastic.serve", description="elastic reference inference replica")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="0 = a free port")
    p.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS), help="model preset (small ones only on CPU)")
    p.add_argument("--max-running", type=int, default=8, help="requests decoded together (running batch)")
    p.add_argument("--max-waiting", type=int, default=64, help="queued requests before answering 429")
    p.add_argument("--tokens-per-second", type=float, default=50.0, help="decode pace per running request")
    p.add_argument("--max-positions", type=int, default=256, help="context window of the model")
    p.add_argument("--max-tokens-limit", type=int, default=128, help="largest max_tokens accepted")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.max_running < 1 or a.max_waiting < 0 or a.tokens_per_second <= 0:
        print("error: --max-running >= 1, --max-waiting >= 0 and --tokens-per-second > 0 are required",
              file=sys.stderr)
        return 2
    # Imported after validation: torch takes seconds to load and bad arguments should fail fast.
    from elastic.serve.server import ReplicaConfig, bind, serve_forever, url_of

    cfg = ReplicaConfig(a.model, a.max_running, a.max_waiting, a.tokens_per_second, a.max_positions,
                        a.max_tokens_limit, a.seed)
    sock = bind(a.host, a.port)
    print(f"elastic-serve listening on {url_of(sock)}", flush=True)
    serve_forever(cfg, sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
