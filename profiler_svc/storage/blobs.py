"""Compressed trace files outside the database, addressed by the SHA-256 of their content.

Layout: ``<root>/<sha[:2]>/<sha>.json.gz``; ``<root>/tmp/`` holds files being received. Paths
are built only from a hex digest, so no user string ever reaches the file system.
"""
import gzip
import hashlib
import os
import re
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

CHUNK = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class Received:
    """A file taken in by `BlobStore.receive`: gzip-compressed in a temporary place."""
    tmp_path: Path
    sha256: str         # of the uncompressed content
    size_bytes: int     # uncompressed
    stored_bytes: int   # compressed


class BlobStore:
    def __init__(self, root):
        self.root = Path(root)
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)

    def relpath(self, sha256: str) -> str:
        if not _SHA256.match(sha256):
            raise ValueError(f"not a sha256 digest: {sha256!r}")
        return f"{sha256[:2]}/{sha256}.json.gz"

    def path(self, relpath: str) -> Path:
        path = (self.root / relpath).resolve()
        if self.root.resolve() not in path.parents:
            raise UserError(f"blob path outside the store: {relpath!r}")
        return path

    def receive(self, source, max_bytes: int | None = None) -> Received:
        """Copy a binary stream (plain or gzip JSON, detected by content) into a temporary gzip file,
        hashing the uncompressed bytes on the way. Never holds the whole file in memory."""
        fd, name = tempfile.mkstemp(suffix=".json.gz", dir=self.root / "tmp")
        tmp_path = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                digest, size = _copy_as_gzip(source, out, max_bytes)
            if size == 0:
                raise UserError("the trace file is empty")
            return Received(tmp_path, digest, size, tmp_path.stat().st_size)
        except BaseException:
            tmp_path.unlink(missing_ok=True)
            raise

    def commit(self, received: Received) -> str:
        """Move a received file to its content address; returns the relative path."""
        relpath = self.relpath(received.sha256)
        final = self.root / relpath
        final.parent.mkdir(exist_ok=True)
        os.replace(received.tmp_path, final)
        return relpath

    def delete(self, relpath: str) -> None:
        self.path(relpath).unlink(missing_ok=True)

    def open(self, relpath: str):
        return gzip.open(self.path(relpath), "rb")


def _copy_as_gzip(source, out, max_bytes):
    """Returns (sha256 hex of the uncompressed content, uncompressed size)."""
    head = source.read(2)
    digest = hashlib.sha256()
    size = 0
    if head == b"\x1f\x8b":
        # Already gzip: keep the bytes as sent, decompress only to hash and to check them.
        inflater = zlib.decompressobj(wbits=31)
        chunk = head
        while chunk:
            out.write(chunk)
            while chunk:
                data = _inflate(inflater, chunk)  # bounded output: a gzip bomb stops at the size limit
                size += len(data)
                _check_size(size, max_bytes)
                digest.update(data)
                chunk = inflater.unconsumed_tail
                if not chunk and inflater.eof and inflater.unused_data:
                    # Concatenated gzip members (e.g. joined with `cat`): go on with a fresh inflater.
                    chunk, inflater = inflater.unused_data, zlib.decompressobj(wbits=31)
            chunk = source.read(CHUNK)
        if not inflater.eof:
            raise UserError("the gzip trace is truncated")
        return digest.hexdigest(), size
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=6, mtime=0) as gz:
        chunk = head
        while chunk:
            size += len(chunk)
            _check_size(size, max_bytes)
            digest.update(chunk)
            gz.write(chunk)
            chunk = source.read(CHUNK)
    return digest.hexdigest(), size


def _inflate(inflater, chunk):
    try:
        return inflater.decompress(chunk, 8 * CHUNK)
    except zlib.error as exc:
        raise UserError(f"the trace is not valid gzip: {exc}") from None


def _check_size(size, max_bytes):
    if max_bytes is not None and size > max_bytes:
        raise UserError(f"the trace is larger than the {max_bytes // (1 << 20)} MiB limit (uncompressed)")
