"""Subcommands: `serve`, `ingest`, `worker`, `token`, `db upgrade`, `demo`."""
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


def _count(text: str) -> int:
    """A number of things, 0 or more."""
    import argparse
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be 0 or more: {text!r}")
    return int(text)


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
    p.add_argument("--threads", type=_positive(int), default=8, help="threads that answer requests")
    p.add_argument("--analysis-workers", type=_count, default=None, metavar="N",
                   help="analyse uploads in N worker threads of this process, each analysis in a child process "
                        "(default: 1 on SQLite, 0 on PostgreSQL, where `profiler_svc worker` hosts do it)")
    p.set_defaults(func=cmd_serve)

    p = subparsers.add_parser("worker", help="run queued jobs: analyses of uploads, A/B tests on this machine's GPU (or CPU)")
    p.add_argument("--kind", choices=("all", "analysis", "ab"), default="all",
                   help="which jobs to take (default: all; a GPU host without the blob store: ab)")
    p.add_argument("--once", action="store_true", help="stop when the queue is empty")
    p.add_argument("--poll", type=_positive(float), default=2.0, metavar="SECONDS", help="queue poll interval")
    p.add_argument("--lease", type=_positive(float), default=120.0, metavar="SECONDS",
                   help="a job whose worker stops heartbeating for this long is requeued")
    p.set_defaults(func=cmd_worker)

    p = subparsers.add_parser("db", help="database administration")
    db_sub = p.add_subparsers(dest="db_command", metavar="COMMAND", required=True)
    up = db_sub.add_parser("upgrade", help="create or migrate the schema to the latest version")
    up.set_defaults(func=cmd_db_upgrade)

    p = subparsers.add_parser("token", help="API tokens for the service: create, list, revoke")
    token_sub = p.add_subparsers(dest="token_command", metavar="COMMAND", required=True)
    t = token_sub.add_parser("create", help="make a token and print it (once: only its hash is stored)")
    t.add_argument("name", help="who or what uses it, e.g. 'ci' or 'alice'")
    t.set_defaults(func=cmd_token_create)
    t = token_sub.add_parser("list", help="the tokens (never the tokens themselves): id, name, created, last used")
    t.set_defaults(func=cmd_token_list)
    t = token_sub.add_parser("revoke", help="revoke a token: refused from its next request on")
    t.add_argument("id", type=_positive(int))
    t.set_defaults(func=cmd_token_revoke)

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


def cmd_token_create(args) -> int:
    from ..storage import tokens
    from ..storage.db import ready_engine, session_scope
    with session_scope(ready_engine()) as session:
        row, token = tokens.create(session, args.name)
        token_id = row.id
    print(token)
    print(f"token {token_id} ({args.name}): shown once, keep it secret; "
          f"revoke with `profiler_svc token revoke {token_id}`", file=sys.stderr)
    return 0


def cmd_token_list(args) -> int:
    from ..storage import tokens
    from ..storage.db import ready_engine, session_scope
    with session_scope(ready_engine()) as session:
        rows = tokens.listing(session)
    print(f"{'id':>4}  {'name':<24} {'created':<20} {'last used':<20} revoked")
    for t in rows:
        print(f"{t['id']:>4}  {t['name'][:24]:<24} {t['created_at'][:19]:<20} {(t['last_used_at'] or '-')[:19]:<20} "
              f"{(t['revoked_at'] or '-')[:19]}")
    return 0


def cmd_token_revoke(args) -> int:
    from ..storage import tokens
    from ..storage.db import ready_engine, session_scope
    with session_scope(ready_engine()) as session:
        row = tokens.revoke(session, args.id)
        name = row.name
    print(f"token {args.id} ({name}) revoked")
    return 0


def cmd_ingest(args) -> int:
    from ..storage.db import ready_engine
    from ..storage.ingest import ingest_path
    results = ingest_path(ready_engine(), args.trace, name=args.name, group_key=args.group,
                          workload=args.workload)
    for r in results:
        state = "already stored" if r.duplicate else "stored"
        print(f"run {r.run_id} trace {r.trace_id}: {state}" + (f" ({r.note})" if r.note else ""))
    return 0


def cmd_worker(args) -> int:
    from ..storage.db import ready_engine
    from .worker import KINDS, default_worker_id, run_worker, use_triton_interpreter_without_gpu
    if args.kind != "analysis":
        use_triton_interpreter_without_gpu()
    from ..trace.load import max_trace_bytes
    max_trace_bytes()  # a bad value stops the worker now, not each analysis (which would fail every upload)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    engine = ready_engine()
    worker = default_worker_id()
    kinds = KINDS if args.kind == "all" else (args.kind,)
    print(f"worker {worker}: waiting for jobs ({', '.join(kinds)})", file=sys.stderr)
    done = run_worker(engine, once=args.once, poll_s=args.poll, worker=worker, lease_s=args.lease, kinds=kinds)
    print(f"worker {worker}: ran {done} job(s)", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    _check_can_listen(args.host, args.port)
    from ..web import create_app
    app = create_app()  # opens the database as every command does
    engine = app.extensions["profiler_svc.engine"]
    analysers = args.analysis_workers if args.analysis_workers is not None else int(engine.dialect.name == "sqlite")
    start_analysis_workers(engine, app.extensions["profiler_svc.blobs"], analysers)
    serve(app, args.host, args.port, threads=args.threads)
    return 0


def start_analysis_workers(engine, blobs, count: int) -> list:
    """Threads of this process that take the analysis queue; each analysis runs in a child process
    under its limits, so the threads that answer requests never parse a trace."""
    import threading
    from .worker import default_worker_id, run_worker
    threads = []
    for n in range(max(0, count)):
        thread = threading.Thread(target=run_worker, args=(engine,), daemon=True, name=f"analysis-worker-{n}",
                                  kwargs={"kinds": ("analysis",), "blobs": blobs, "poll_s": 1.0,
                                          "worker": f"{default_worker_id()}:serve{n}"})
        thread.start()
        threads.append(thread)
    return threads


def cmd_demo(args) -> int:
    from .demo import prepare_demo, start_background_worker
    from .worker import use_triton_interpreter_without_gpu
    use_triton_interpreter_without_gpu()
    app = prepare_demo(print_fn=print)
    if args.no_serve:
        return 0
    start_background_worker(app.config["DATABASE_URL"], app.config["BLOB_DIR"])
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


def serve(app, host: str, port: int, threads: int = 8) -> None:
    """Waitress: it reads each request whole (headers and body) in its event loop before a thread
    runs the app, so slow or stalled clients hold no thread, and idle connections are closed."""
    from waitress import serve as waitress_serve
    waitress_serve(app, host=host, port=port, threads=threads, ident="profiler_svc",
                   connection_limit=1000, channel_timeout=60, asyncore_use_poll=True,
                   max_request_body_size=app.config["MAX_CONTENT_LENGTH"] or (1 << 40))
