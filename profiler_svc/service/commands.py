"""Subcommands: `serve`, `ingest`, `worker`, `db upgrade`, `demo`."""
import logging
import sys

from ..errors import UserError
from ..formats import one_line


def _port(text: str) -> int:
    import argparse
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r}")
    return int(text)


def _positive(kind):
    def parse(text: str):
        import argparse
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < float("inf"):  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}: {text!r}")
        return value
    return parse


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("ingest", help="store a trace (or a folder of per-rank traces) and its analysis")
    p.add_argument("trace", help=".json or .json.gz trace, or a folder of per-rank traces (one run)")
    p.add_argument("--name", help="run name (default: the file or folder name)")
    p.add_argument("--run", dest="group", metavar="KEY",
                   help="group key: traces ingested with the same key join one run (e.g. one job's ranks)")
    p.add_argument("--workload", metavar="PKG.MODULE:FACTORY", help="workload for A/B tests from the dashboard")
    p.set_defaults(func=cmd_ingest)

    p = subparsers.add_parser("serve", help="serve the dashboard and the API on this machine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--workers", type=_positive(int), default=2, help="gunicorn worker processes")
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("worker", help="run queued A/B jobs on this machine's GPU (or CPU)")
    p.add_argument("--once", action="store_true", help="stop when the queue is empty")
    p.add_argument("--poll", type=_positive(float), default=2.0, metavar="SECONDS", help="queue poll interval")
    p.add_argument("--lease", type=_positive(float), default=120.0, metavar="SECONDS",
                   help="a job whose worker stops heartbeating for this long is requeued")
    p.set_defaults(func=cmd_worker)

    p = subparsers.add_parser("db", help="database administration")
    db_sub = p.add_subparsers(dest="db_command", metavar="COMMAND", required=True)
    up = db_sub.add_parser("upgrade", help="create or migrate the schema to the latest version")
    up.set_defaults(func=cmd_db_upgrade)

    p = subparsers.add_parser("demo", help="ingest bundled GPU traces and a live CPU capture, then serve the dashboard")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--no-serve", action="store_true", help="prepare the demo database and exit")
    p.set_defaults(func=cmd_demo)


def cmd_db_upgrade(args) -> int:
    from ..storage.db import _redact, get_engine, upgrade
    engine = get_engine()
    try:
        upgrade(engine)
    except Exception as exc:
        raise UserError(f"cannot migrate {_redact(str(engine.url))}: {one_line(exc)}") from None
    print(f"database {_redact(str(engine.url))} is at the latest schema")
    return 0


def cmd_ingest(args) -> int:
    from ..storage.db import ready_engine
    from ..storage.ingest import ingest_path
    results = ingest_path(ready_engine(), args.trace, name=args.name, group_key=args.group,
                          workload=args.workload)
    for r in results:
        state = "already stored" if r.duplicate else "stored"
        print(f"run {r.run_id} trace {r.trace_id}: {state}")
    return 0


def cmd_worker(args) -> int:
    from ..storage.db import ready_engine
    from .worker import default_worker_id, run_worker, use_triton_interpreter_without_gpu
    use_triton_interpreter_without_gpu()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    engine = ready_engine()
    worker = default_worker_id()
    print(f"worker {worker}: waiting for A/B jobs", file=sys.stderr)
    done = run_worker(engine, once=args.once, poll_s=args.poll, worker=worker, lease_s=args.lease)
    print(f"worker {worker}: ran {done} job(s)", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from ..storage.db import ready_engine
    ready_engine()
    _check_can_listen(args.host, args.port)
    from ..web import create_app
    serve(create_app(), args.host, args.port, workers=args.workers)
    return 0


def cmd_demo(args) -> int:
    from .demo import prepare_demo, start_background_worker
    from .worker import use_triton_interpreter_without_gpu
    use_triton_interpreter_without_gpu()
    app = prepare_demo(print_fn=print)
    if args.no_serve:
        return 0
    start_background_worker(app.config["DATABASE_URL"])
    from werkzeug.serving import make_server
    _check_can_listen(args.host, args.port)
    server = make_server(args.host, args.port, app, threaded=True)
    print(f"dashboard: http://{args.host}:{server.port}/  (Ctrl-C to stop)", flush=True)
    server.serve_forever()
    return 0


def _check_can_listen(host: str, port: int) -> None:
    """One clear line for a busy port or a bad address, before a server starts retrying and logging."""
    import socket
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(infos[0][4])
    except (OSError, OverflowError) as exc:  # OverflowError: a port beyond 65535
        raise UserError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None


def serve(app, host: str, port: int, workers: int = 2) -> None:
    """gunicorn when available (a production server), else Werkzeug's threaded server."""
    from ..storage.db import after_fork
    try:
        from gunicorn.app.base import BaseApplication
    except ImportError:
        app.run(host=host, port=port, threaded=True)
        return

    class Server(BaseApplication):
        def load_config(self):
            self.cfg.set("bind", f"{host}:{port}")
            self.cfg.set("workers", workers)
            self.cfg.set("threads", 4)
            self.cfg.set("timeout", 300)  # large uploads are analysed inside the request
            self.cfg.set("post_fork", lambda _server, _worker: after_fork())

        def load(self):
            return app

    Server().run()
