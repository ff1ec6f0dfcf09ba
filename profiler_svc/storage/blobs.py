"""Compressed trace files outside the database, addressed by the SHA-256 of their content.

Layout: ``<root>/<sha[:2]>/<sha>.json.gz``; ``<root>/tmp/`` holds files being received. Paths
are built only from a hex digest, so no user string ever reaches the file system.

A file being received is locked (``flock``) until its receiver is done with it, so a process that
starts can remove what crashed receivers left in ``tmp/`` (`clean_tmp`) without touching live ones.
"""
import fcntl
import gzip
import hashlib
import os
import re
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..trace.load import MAX_GZIP_RATIO, inflated_too_far

CHUNK = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass
class Received:
    """A file taken in by `BlobStore.receive`: gzip-compressed in a temporary place."""
    tmp_path: Path
    sha256: str         # of the uncompressed content
    size_bytes: int     # uncompressed
    stored_bytes: int   # compressed
    lock_fd: int = -1   # holds the flock that keeps `clean_tmp` away; `release` when done

    def release(self) -> None:
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


class BlobStore:
    def __init__(self, root):
        self.root = Path(root)
        try:
            (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # e.g. PROFILER_SVC_BLOB_DIR names a file, or a place this user cannot write
            raise UserError(f"cannot use {self.root} as the folder of trace files: {exc.strerror or exc}") from None

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
        fd, tmp_path = self._new_tmp()
        lock_fd = os.dup(fd)  # the lock lives as long as one descriptor of this open file does
        try:
            with os.fdopen(fd, "wb") as out:
                digest, size = _copy_as_gzip(source, out, max_bytes)
            if size == 0:
                raise UserError("the trace file is empty")
            return Received(tmp_path, digest, size, tmp_path.stat().st_size, lock_fd)
        except BaseException:
            tmp_path.unlink(missing_ok=True)
            os.close(lock_fd)
            raise

    def _new_tmp(self):
        while True:
            fd, name = tempfile.mkstemp(suffix=".json.gz", dir=self.root / "tmp")
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink:
                return fd, Path(name)
            os.close(fd)  # `clean_tmp` removed it between its creation and our lock: take another

    def clean_tmp(self) -> int:
        """Remove the files that receivers which died (kill -9, power loss) left in tmp/; returns how many."""
        removed = 0
        for path in (self.root / "tmp").iterdir():
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                path.unlink()
                removed += 1
            except OSError:  # locked: a live receiver's
                pass
            finally:
                os.close(fd)
        return removed

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
        chunk, consumed = head, 0
        while chunk:
            out.write(chunk)
            consumed += len(chunk)
            while chunk:
                data = _inflate(inflater, chunk)  # bounded output: a gzip bomb stops at the size limit
                size += len(data)
                _check_size(size, max_bytes)
                if inflated_too_far(size, consumed):  # ... or sooner, at the loader's ratio
                    raise UserError(f"the trace decompresses to over {MAX_GZIP_RATIO}x its compressed size, "
                                    "which no trace does (a decompression bomb?)")
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
