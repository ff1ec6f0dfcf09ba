"""The WSGI entry: a start-up error is one line and gunicorn's app-load status, not a traceback."""
import os
import subprocess
import sys


def test_an_unreachable_database_is_one_line_at_start(tmp_path):
    env = {**os.environ, "PROFILER_SVC_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
           "PROFILER_SVC_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", "import profiler_svc.web.wsgi"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 4
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("profiler_svc: error: ")
    assert "Traceback" not in done.stderr and "cannot open the database" in done.stderr


def test_the_app_loads_on_a_fresh_sqlite_home(tmp_path):
    env = {**os.environ, "PROFILER_SVC_HOME": str(tmp_path)}
    env.pop("PROFILER_SVC_DATABASE_URL", None)
    done = subprocess.run([sys.executable, "-c", "from profiler_svc.web.wsgi import app; print(app.name)"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
