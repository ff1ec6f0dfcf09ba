"""`profiler_svc serve` serves the dashboard and takes uploads; on SQLite it analyses them in a worker
thread of its own, each analysis in a child process."""
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


def get_json(url):
    request = urllib.request.Request(url, headers={"Authorization": "Bearer serve-token"})
    return json.loads(urllib.request.urlopen(request, timeout=10).read())


def test_serve(tmp_path):
    port = free_port()
    env = {**os.environ, "PROFILER_SVC_HOME": str(tmp_path), "PROFILER_SVC_TOKEN": "serve-token"}
    env.pop("PROFILER_SVC_DATABASE_URL", None)
    server = subprocess.Popen([sys.executable, "-m", "profiler_svc.cli", "serve", "--port", str(port),
                               "--threads", "4"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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
        answer = urllib.request.urlopen(request, timeout=60)
        assert answer.status == 202
        status_url = base + json.loads(answer.read())["status_url"]
        deadline = time.monotonic() + 120
        while (status := get_json(status_url))["status"] in ("queued", "running"):
            assert time.monotonic() < deadline, status
            time.sleep(0.3)
        assert status["status"] == "done", status
        run = get_json(f"{base}/api/v1/runs/{status['run_id']}")
        assert run["name"] == "served" and run["summary"]["kernel_count"] > 0
        assert (tmp_path / "profiler_svc.sqlite3").exists()  # the documented default location
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
