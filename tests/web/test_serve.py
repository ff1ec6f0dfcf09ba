"""`profiler_svc serve` starts gunicorn with forked workers that serve the dashboard and take uploads."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from tests.plugins.traces import SMALL_TRACE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve(tmp_path):
    port = free_port()
    env = {**os.environ, "PROFILER_SVC_HOME": str(tmp_path), "PROFILER_SVC_TOKEN": "serve-token"}
    env.pop("PROFILER_SVC_DATABASE_URL", None)
    server = subprocess.Popen([sys.executable, "-m", "profiler_svc.cli", "serve", "--port", str(port),
                               "--workers", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert urllib.request.urlopen(base + "/", timeout=5).status == 200
                break
            except OSError:
                assert server.poll() is None, server.stdout.read().decode()
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.3)
        request = urllib.request.Request(base + "/api/v1/traces?name=served", data=SMALL_TRACE.read_bytes(),
                                         headers={"Authorization": "Bearer serve-token",
                                                  "Content-Type": "application/gzip"}, method="POST")
        reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
        # Several requests so both forked workers answer from the shared SQLite file.
        for _ in range(6):
            run = json.loads(urllib.request.urlopen(f"{base}/api/v1/runs/{reply['run_id']}", timeout=10).read())
            assert run["name"] == "served" and run["summary"]["kernel_count"] > 0
        assert (tmp_path / "profiler_svc.sqlite3").exists()  # the documented default location
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
