"""Storage and service back end: the database (models, engine, migrations), the blob store for
compressed traces, ingest, the read queries behind the dashboard, the A/B job queue and its worker.

See docs/service.md. The web app lives in ``profiler_svc.web``; the CLI in ``commands.py``.
"""


def save_ab_result(result: dict, **kwargs) -> int:
    """Store an `ABResult.to_dict()` from the CLI as a done A/B job (see storage.jobs.save_ab_result)."""
    from .jobs import save_ab_result as save
    return save(result, **kwargs)
