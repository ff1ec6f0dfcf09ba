"""Storage and service back end: the database (models, engine, migrations), the blob store for
compressed traces, ingest, the read queries behind the dashboard, the A/B job queue and its worker.

See docs/service.md. The web app lives in ``profiler_svc.web``; the CLI in ``commands.py``.
"""
