"""Persistence: the database (models, engine, migrations), the blob store for compressed traces,
ingest, the read queries behind the dashboard and the A/B job queue.

See docs/service.md. Nothing here imports the web app, A/B, capture or the service commands
(``profiler_svc.service``), which sit above it.
"""


def save_ab_result(result: dict, **kwargs) -> int:
    """Store an `ABResult.to_dict()` from the CLI as a done A/B job (see storage.jobs.save_ab_result)."""
    from .jobs import save_ab_result as save
    return save(result, **kwargs)
