"""``elastic.metrics.scrape.shared_client``: one client for one-off replica reads, no connection kept."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from elastic.metrics.scrape import scrape_sum, shared_client


class _Metrics(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # the server would keep a connection open if the client asked
    peers: list[Any] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.peers.append(self.client_address)
        body = b"vllm:num_requests_running 3\nvllm:num_requests_waiting 1\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def test_one_client_for_every_thread_and_a_fresh_connection_for_every_read() -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        seen: list[Any] = []
        threads = [threading.Thread(target=lambda: seen.append(shared_client())) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert len({id(c) for c in seen}) == 1 and seen[0] is shared_client()
        sums = [scrape_sum(url, ("vllm:num_requests_running", "vllm:num_requests_waiting")) for _ in range(3)]
        assert sums == [4.0, 4.0, 4.0]
        assert len(set(_Metrics.peers)) == 3, "no connection is kept alive between two reads"
    finally:
        srv.shutdown()
        srv.server_close()
    assert scrape_sum(url, ("vllm:num_requests_running",), timeout=0.5) is None, "a server that is gone: None"
