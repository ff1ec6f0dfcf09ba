"""POST a captured trace to a running profiler_svc service's ingest API (stdlib only).

``POST {url}/api/v1/traces`` with ``Authorization: Bearer <PROFILER_SVC_TOKEN>`` and a
multipart form: ``file`` (the .json.gz), ``name``, ``run`` (the group key shared by the
ranks of one job) and, where known, ``host`` and ``workload``.
"""
import json
import os
import urllib.error
import urllib.request
import uuid

INGEST_PATH = "/api/v1/traces"
TOKEN_ENV = "PROFILER_SVC_TOKEN"


class UploadError(Exception):
    """The service could not be reached or refused the trace; the message is one line."""


def _multipart(fields: dict, file_field: str, path: str):
    boundary = uuid.uuid4().hex
    parts = []
    for key, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{value}\r\n'.encode())
    filename = os.path.basename(path)
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}"; '
                 f'filename="{filename}"\r\nContent-Type: application/gzip\r\n\r\n'.encode())
    with open(path, "rb") as f:
        parts.append(f.read())
    parts.append(f"\r\n--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def upload_trace(url: str, path: str, *, name: str, run: str, host=None, workload=None, token=None,
                 timeout=120) -> dict:
    """Upload one trace file; returns the service's JSON reply. Raises UploadError."""
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    fields = {"name": name, "run": run, "host": host, "workload": workload}
    body, content_type = _multipart({k: v for k, v in fields.items() if v}, "file", path)
    request = urllib.request.Request(url.rstrip("/") + INGEST_PATH, data=body, method="POST",
                                     headers={"Content-Type": content_type})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            reply = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read(300).decode("utf-8", "replace").strip().replace("\n", " ")
        raise UploadError(f"{request.full_url} answered HTTP {exc.code}: {detail or exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UploadError(f"could not reach {request.full_url}: {reason}") from None
    try:
        return json.loads(reply) if reply.strip() else {}
    except ValueError:
        return {"reply": reply[:300].decode("utf-8", "replace")}
