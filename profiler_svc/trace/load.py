"""Load Kineto/Chrome traces into columnar tables linked kernel -> launch -> op -> parent -> module.

Reading streams, whatever the layout (Kineto's indented one, minified JSON, the Chrome array format):
_Cutter follows the JSON nesting of each (gunzipped) ~4 MB chunk with a few numpy passes, strings and
escapes included (which bytes lie in strings is a prefix XOR of the quote bits, 64 at a time, in reused
buffers), and cuts it at the last event's end; msgspec decodes each batch of whole events straight
into typed structs (unknown fields skipped), which become numpy columns before the next chunk arrives. So
memory holds the tables of the events kept, never the document, and whitespace between events is skipped
for free. Bad input of any kind is a one-line TraceError; caps on one event, the top-level fields, nesting
depth, names and the gzip ratio bound both the memory and the work per input byte.
Linking is numpy's: each CPU event's parent (the stack sweep's answer), its module and its top-level op
come from pointer jumping, a few rounds over arrays instead of a Python loop over events.
"""
import math
import os
import re
import sys
import zlib
from pathlib import Path
from typing import Union, cast

try:
    import resource
except ImportError:  # not on Windows: no address-space limit to respect there
    resource = None  # type: ignore[assignment]
import msgspec
import numpy as np
import pandas as pd

from ..errors import TraceError, setting_int
from . import labels
from .device import device_from_properties
from .kernel_names import kernel_kinds, name_mask
from .model import RawInputs, Trace, launch_times
from .schema import ANY_DECODER, ARRAY_DECODER, TOP_LEVEL_DECODER, TraceEvent

# A decompressed trace above this is refused while it is read (gzip bombs included); PROFILER_SVC_MAX_TRACE_BYTES
# sets another, read when a trace is (a bad value fails that read, not `import profiler_svc`).
DEFAULT_MAX_TRACE_BYTES = 8 << 30
TRACE_SUFFIXES = (".json", ".json.gz", ".pt.trace.json", ".pt.trace.json.gz")
_CHUNK = 4 << 20  # decompressed bytes per batch; the scan's numpy temporaries are a few times this
_PROGRESS_MIN_BYTES = 64 << 20
# Kineto's events are under a few hundred kB and its other top-level fields a few MB: anything far
# bigger is hostile, and refusing it keeps memory flat whatever the file holds.
_MAX_EVENT_BYTES = 16 << 20
_MAX_FIELDS_BYTES = 16 << 20
# Address space a batch's decode may need, per byte of its JSON: msgspec (0.22) crashes with SIGSEGV, not
# MemoryError, when an allocation fails inside it, as under the analysis sandbox's RLIMIT_AS. Below this
# headroom the loader raises MemoryError itself.
_DECODE_HEADROOM = 4
_MAX_DEPTH = 64             # Kineto nests 7 deep; msgspec would raise RecursionError near 1000
# Real traces gunzip 12-20x (tests/data, tiled ones too); a deflate bomb reaches ~1000x.
MAX_GZIP_RATIO = 100
GZIP_RATIO_AFTER = 16 << 20
_MAX_DURATION_US = 86400e6  # a day: no profiled event lasts longer, and no trace spans more
# A kernel may run on after the host's last event (the profiler stopped with work queued), not by more than this
# and this many times the host side's span
_KERNEL_AFTER_HOST_US = 10e6
_KERNEL_AFTER_HOST_SPANS = 10
_LINK_ROUNDS = 64
_JSON_SPACE = b" \t\r\n"
_BOM = b"\xef\xbb\xbf"
# Category names across Kineto versions (PyTorch 1.8 wrote "Kernel", "Runtime", "Operator", ...),
# mapped to the names the tables use.
_KERNEL_CATS = {"kernel": "kernel", "Kernel": "kernel"}
_CPU_CATS = {"cpu_op": "cpu_op", "Operator": "cpu_op", "user_annotation": "user_annotation",
             "python_function": "python_function"}
_RUNTIME_CATS = {"cuda_runtime", "cuda_driver", "runtime", "Runtime"}
_MEMORY_CATS = {"gpu_memcpy", "gpu_memset", "Memcpy", "Memset"}
_NAME_OR_SLICE = frozenset("MBE")  # phases besides "X" that the tables use: thread names, B/E slices
_SEP = b"\x01"
_NO_INPUTS = _SEP * 3


def max_trace_bytes() -> int:
    return setting_int(os.environ, "PROFILER_SVC_MAX_TRACE_BYTES", DEFAULT_MAX_TRACE_BYTES)


def trace_files(path) -> list[Path]:
    """The trace files behind PATH: the file itself, or every trace file in a folder (per-rank traces)."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{path}: no such file or folder")
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(TRACE_SUFFIXES))
        if not files:
            raise TraceError(f"{path}: folder holds no trace files (*.json or *.json.gz)")
        return files
    return [p]


def load_traces(path, progress=None) -> list[Trace]:
    """Every trace under PATH (one per rank for a folder), sorted by rank: a file that names no rank takes the
    lowest one no other file names; two files naming one rank are two jobs' files, not one job's."""
    traces = [load_trace(f, progress=progress) for f in trace_files(path)]
    named: dict = {}
    for trace in traces:
        if trace.rank is not None and named.setdefault(trace.rank, trace) is not trace:
            first = named[trace.rank]
            run = first.capture_metadata.get("run")
            why = ("two cycles of one capture (its repeat writes a file a cycle): analyse each file alone"
                   if run is not None and run == trace.capture_metadata.get("run")
                   else "a folder holds one job's traces, one file a rank")
            raise TraceError(f"{path}: {Path(first.path).name} and {Path(trace.path).name} are both rank {trace.rank}, "
                             f"{why}")
    _refuse_windows_of_one_process(path, [t for t in traces if t.rank is None])
    free = (r for r in range(len(traces) + len(named)) if r not in named)
    for trace in traces:
        if trace.rank is None:
            trace.rank = next(free)
    return sorted(traces, key=lambda t: cast(int, t.rank))  # every rank set just above


def _refuse_windows_of_one_process(path, unnamed: list) -> None:
    """Traces naming no rank from one process (its pid) at different times: windows of one run (a TensorBoard log
    folder holds a file a window), not a job's ranks, which run at once (ranks in containers may share a pid)."""
    seen: dict = {}
    for trace in unnamed:
        for pid in {pid for pid, _ in trace.threads.values() if isinstance(pid, int) and pid > 0}:
            other = seen.setdefault(pid, trace)
            if other is not trace and (trace.clock_span[0] >= other.clock_span[1]
                                       or other.clock_span[0] >= trace.clock_span[1]):
                raise TraceError(f"{path}: {Path(other.path).name} and {Path(trace.path).name} name no rank and come "
                                 f"from one process (pid {pid}) at different times: windows of one run (a TensorBoard "
                                 "log folder holds a file a window), not a job's ranks; analyse each file alone")


def load_trace(path, progress=None) -> Trace:
    builder = TableBuilder(str(path))
    cutter = _Cutter(str(path), builder)
    for chunk in byte_chunks(path, progress):
        cutter.feed(chunk)
    return builder.finish(cutter.finish())


# -- bytes ----------------------------------------------------------------------------------------

def _address_space_left():
    """Bytes of address space this process may still map under its RLIMIT_AS, or None without a limit."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
    except OSError:  # no /proc (macOS): the limit cannot be compared with what is mapped
        return None
    return soft - mapped


def byte_chunks(path, progress=None):
    """The file's JSON bytes in chunks, gunzipped when the content (not the name) says gzip, BOM removed."""
    p = Path(path)
    try:
        if not p.is_file():
            raise TraceError(f"{path}: not a regular file")
        size = p.stat().st_size
        if size == 0:
            raise TraceError(f"{path}: file is empty")
        f = open(p, "rb")
    except TraceError:
        raise
    except PermissionError:
        raise TraceError(f"{path}: permission denied") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    bar = _progress_bar(progress, size, f"reading {p.name}")
    try:
        with f:
            is_gzip = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            if is_gzip:
                chunks = _gunzip_chunks(f, path, bar)
            else:
                limit = max_trace_bytes()
                if size > limit:
                    raise TraceError(f"{path}: {size / 1e9:.1f} GB is over the {limit / 1e9:.1f} GB "
                                     "limit (PROFILER_SVC_MAX_TRACE_BYTES)")
                chunks = _file_chunks(f, bar)
            first = True
            for chunk in chunks:
                if first and chunk.startswith(_BOM):  # UTF-8 BOM (Windows tools write one)
                    chunk = chunk[len(_BOM):]
                first = False
                if chunk:
                    yield chunk
    finally:
        if bar:
            bar.close()


def _file_chunks(f, bar):
    while chunk := f.read(_CHUNK):
        if bar:
            bar.update(len(chunk))
        yield chunk


def _gunzip_chunks(f, path, bar):
    """Decompressed chunks of at most _CHUNK bytes: memory stays flat and the limits act mid-stream."""
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
    total = consumed = 0
    limit = max_trace_bytes()
    try:
        while not decompressor.eof and (chunk := f.read(_CHUNK // 4)):
            if bar:
                bar.update(len(chunk))
            while chunk and not decompressor.eof:
                out = decompressor.decompress(chunk, _CHUNK)
                consumed += len(chunk) - len(decompressor.unconsumed_tail) - len(decompressor.unused_data)
                total += len(out)
                _check_gunzipped(path, total, consumed, limit)
                if out:
                    yield out
                chunk = decompressor.unconsumed_tail
        if not decompressor.eof:
            tail = decompressor.flush()
            total += len(tail)
            _check_gunzipped(path, total, consumed, limit)
            if tail:
                yield tail
    except zlib.error as exc:
        raise TraceError(f"{path}: broken gzip data ({exc})") from None
    if not decompressor.eof:
        raise TraceError(f"{path}: gzip stream is truncated")
    after = decompressor.unused_data + f.read(2)
    if after.startswith(b"\x1f\x8b"):
        raise TraceError(f"{path}: holds more than one gzip member (concatenated files are not one trace)")
    if after:
        raise TraceError(f"{path}: has data after the end of its gzip stream")
    if total == 0:
        raise TraceError(f"{path}: gzip holds an empty file")


def inflated_too_far(total: int, consumed: int) -> bool:
    """Has a gzip stream inflated past what any trace does (a decompression bomb): TOTAL bytes out of CONSUMED?"""
    return total > GZIP_RATIO_AFTER and total > MAX_GZIP_RATIO * consumed


def _check_gunzipped(path, total, consumed, limit):
    if total > limit:
        raise TraceError(f"{path}: decompresses to over the {limit / 1e9:.1f} GB limit "
                         "(PROFILER_SVC_MAX_TRACE_BYTES)")
    if inflated_too_far(total, consumed):
        raise TraceError(f"{path}: decompresses to over {MAX_GZIP_RATIO}x its compressed size, which no trace "
                         "does (a decompression bomb?)")


def _progress_bar(progress, total, desc):
    if progress is None:
        progress = sys.stderr.isatty() and total >= _PROGRESS_MIN_BYTES
    if not progress:
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, leave=False, file=sys.stderr)


# -- JSON ------------------------------------------------------------------------------------------

_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)


def _invalid_utf8(exc: Exception) -> bool:
    """Did decoding stop at bytes that are not UTF-8? (msgspec 0.22 raises UnicodeDecodeError, 0.23 a
    DecodeError saying so.)"""
    return isinstance(exc, UnicodeDecodeError) or (isinstance(exc, msgspec.DecodeError) and "UTF-8" in str(exc))


class _Cutter:
    """Cuts a trace document of any layout, fed in chunks, into batches of whole events for TableBuilder,
    keeping the other top-level fields aside. It follows the nesting (strings and escapes included) with
    a few numpy passes per chunk; msgspec still validates every byte that is not whitespace."""

    def __init__(self, path: str, builder):
        self.path, self.builder = path, builder
        self.depth, self.in_string, self.escape = 0, False, False  # nesting state after the bytes read
        self.step = self._start
        self.level = 0               # depth inside the events array: 1 (array format) or 2 (in an object)
        self.fields = bytearray()    # the document without its events, for the top-level fields
        self.pending = bytearray()   # the start of an event whose end has not arrived yet
        self.offset = 0              # document offset of the data being read
        self.batch_at = 0            # document offset of the batch being gathered
        self.events = 0              # events decoded so far
        self.after_event = False     # an event has ended: a comma, then another event or the array's end
        self.comma = False
        self.found_events = False
        self.scratch = _Scratch()

    def feed(self, data: bytes) -> None:
        while data:
            data = self.step(data)

    def finish(self) -> dict:
        if self.step == self._start:
            raise TraceError(f"{self.path}: holds only whitespace, not JSON")
        if self.step == self._events and self.level == 1 and not self.pending:
            pass  # Chrome's array format may leave out the closing bracket (and keep a trailing comma)
        elif self.step != self._done:
            where = "inside traceEvents" if self.step == self._events else "before its end"
            raise TraceError(f"{self.path}: truncated JSON: the document stops at byte {self.offset}, {where}")
        if self.level == 1:
            return {}
        try:
            top = TOP_LEVEL_DECODER.decode(self.fields)  # the document, its traceEvents blanked to []
            if "traceEvents" not in top:
                raise TraceError(f"{self.path}: not a Kineto/Chrome trace: it has no traceEvents")
            if bytes(top["traceEvents"]) != b"[]":
                raise TraceError(f"{self.path}: not a Kineto/Chrome trace: traceEvents is not a list")
            return {key: ANY_DECODER.decode(raw) for key, raw in top.items() if key != "traceEvents"}
        except _DECODE_ERRORS as exc:
            raise self._error(exc) from None

    # -- steps: each reads a prefix of DATA and returns the rest --

    def _start(self, data):
        rest = _lstrip_space(data)
        self.offset += len(data) - len(rest)
        if not rest:
            return rest
        if rest[:1] == b"{":
            self.step, self.level = self._fields, 2
            return rest
        if rest[:1] == b"[":
            self.step, self.level, self.depth = self._events, 1, 1
            self.offset += 1
            return rest[1:]
        raise TraceError(f"{self.path}: not JSON (a trace starts with '{{' or '[')")

    def _fields(self, data):
        """Top-level fields of the object format, up to traceEvents' '[' or the document's end."""
        if not self.in_string:  # whitespace that opens a chunk is between tokens: skip it for free
            rest = _lstrip_space(data)
            self.offset += len(data) - len(rest)
            data = rest
            if not data:
                return data
        pos, char, depth, state = self._scan(data)
        ends = np.flatnonzero(depth == 0)
        stop = int(pos[ends[0]]) + 1 if len(ends) else len(data)
        for i in np.flatnonzero((char == ord("[")) & (depth == 2)).tolist():
            p = int(pos[i])
            if p >= stop:
                break
            if self._is_events_key(data, p):
                if self.found_events:
                    raise TraceError(f"{self.path}: traceEvents appears twice")
                self.found_events = True
                self._keep_fields(data[:p + 1])
                self.offset += p + 1
                self.step, (self.depth, self.in_string, self.escape) = self._events, (2, False, False)
                return data[p + 1:]
        self._keep_fields(data[:stop])
        self.offset += stop
        if len(ends):
            self.step, (self.depth, self.in_string, self.escape) = self._done, (0, False, False)
        else:
            self.depth, self.in_string, self.escape = state
        return data[stop:]

    def _events(self, data):
        if not self.pending:
            data = self._between_events(data)
            if not data:
                return data
        pos, char, depth, state = self._scan(data)
        closed = np.flatnonzero(depth < self.level)
        k = int(closed[0]) if len(closed) else len(pos)
        ends = np.flatnonzero((char[:k] == ord("}")) & (depth[:k] == self.level))
        if len(ends):
            if self.pending and len(self.pending) + int(pos[ends[0]]) >= _MAX_EVENT_BYTES:
                self._hold(data[:int(pos[ends[0]]) + 1])  # refuses the event whose start was held
            cut = int(pos[ends[-1]]) + 1
            self._decode(data[:cut])
            self.offset += cut
            self.depth, self.in_string, self.escape = self.level, False, False
            return data[cut:]
        if k == len(pos):
            self._hold(data)
            self.offset += len(data)
            self.depth, self.in_string, self.escape = state
            return b""
        stop = int(pos[k])  # the events array closes here
        if char[k] != ord("]"):
            raise TraceError(f"{self.path}: malformed JSON: unbalanced '}}' at byte {self.offset + stop}")
        self._hold(data[:stop])
        if self.pending.strip(_JSON_SPACE):
            self._decode(b"")  # not an event (a number, a list...): msgspec says what is wrong
        elif self.comma:
            raise TraceError(f"{self.path}: malformed JSON: a comma before traceEvents' ']' at byte {self.offset}")
        self.pending.clear()
        self.offset += stop
        self.depth, self.in_string, self.escape = self.level, False, False
        if self.level == 2:
            self.step = self._fields
            return data[stop:]
        self.step, self.depth = self._done, 0
        self.offset += 1
        return data[stop + 1:]

    def _done(self, data):
        rest = _lstrip_space(data)
        if rest:
            raise TraceError(f"{self.path}: data after the end of the JSON document at byte "
                             f"{self.offset + len(data) - len(rest)}")
        self.offset += len(data)
        return rest

    # -- helpers --

    def _between_events(self, data):
        """Skip whitespace (any amount, for free) and the comma between two events."""
        rest = _lstrip_space(data)
        if self.after_event and not self.comma and rest[:1] == b",":
            self.comma = True
            rest = _lstrip_space(rest[1:])
        elif self.after_event and not self.comma and rest and rest[:1] != b"]":
            raise TraceError(f"{self.path}: malformed JSON: no comma between two events at byte "
                             f"{self.offset + len(data) - len(rest)}")
        self.offset += len(data) - len(rest)
        self.batch_at = self.offset
        return rest

    def _hold(self, data):
        self.pending += data
        if len(self.pending) > _MAX_EVENT_BYTES:
            raise TraceError(f"{self.path}: the event at byte {self.batch_at} is over "
                             f"{_MAX_EVENT_BYTES >> 20} MB, which no trace event is")

    def _keep_fields(self, data):
        self.fields += data
        if len(self.fields) > _MAX_FIELDS_BYTES:
            raise TraceError(f"{self.path}: its top-level fields besides traceEvents are over "
                             f"{_MAX_FIELDS_BYTES >> 20} MB, which no trace's are")

    def _decode(self, tail):
        batch = bytearray(b"[")
        batch += self.pending
        batch += tail
        batch += b"]"
        self.pending.clear()
        left = _address_space_left()
        if left is not None and left < _DECODE_HEADROOM * len(batch):
            raise MemoryError(f"{len(batch)} bytes of events to decode with {max(left, 0) >> 20} MiB of address "
                              "space left")
        try:
            events = ARRAY_DECODER.decode(batch)
        except _DECODE_ERRORS as exc:
            if not _invalid_utf8(exc):
                raise self._error(exc, self.batch_at - 1) from None
            try:
                batch.decode()
            except UnicodeDecodeError as bad:
                raise TraceError(f"{self.path}: invalid UTF-8 at byte {self.batch_at - 1 + bad.start}") from None
            raise TraceError(f"{self.path}: invalid UTF-8 in the events from byte {self.batch_at}") from None
        self.builder.add(events)
        self.events += len(events)
        self.after_event, self.comma = True, False

    def _error(self, exc, offset=None) -> TraceError:
        """One line for a msgspec error on a batch at document OFFSET (None: on the top-level fields),
        its positions made the document's: byte offsets and event indexes."""
        if _invalid_utf8(exc):
            return TraceError(f"{self.path}: invalid UTF-8 in a string of the top-level fields")
        message = str(exc)
        if offset is None:
            message = re.sub(r" \(byte \d+\)", "", message) + " (in the top-level fields)"
        else:
            message = re.sub(r"\(byte (\d+)\)", lambda m: f"(byte {offset + int(m.group(1))})", message)
            events = "traceEvents" if self.level == 2 else "$"
            message = re.sub(r"`\$\[(\d+)\]", lambda m: f"`{events}[{self.events + int(m.group(1))}]", message)
        if isinstance(exc, msgspec.ValidationError):
            return TraceError(f"{self.path}: not a Kineto/Chrome trace: {message}")
        return TraceError(f"{self.path}: malformed JSON: {message}")

    def _is_events_key(self, data, pos) -> bool:
        """Whether the '[' at DATA[POS] opens the value of the top-level key "traceEvents"."""
        behind = _Behind(self.fields, data, pos)
        behind.skip_space()
        if behind.take(1) != b":":
            return False
        behind.skip_space()
        return behind.take(13) == b'"traceEvents"' and behind.take(1) != b"\\"

    def _scan(self, data):
        """Positions, bytes and depths after of the brackets outside strings in DATA, and the nesting
        state after DATA (not yet adopted: a step may read only part of DATA)."""
        pos, char, depth, state = _brackets(data, self.depth, self.in_string, self.escape, self.scratch)
        if len(depth) and depth.max() > _MAX_DEPTH:
            at = self.offset + int(pos[np.argmax(depth > _MAX_DEPTH)])
            raise TraceError(f"{self.path}: nested deeper than {_MAX_DEPTH} levels at byte {at}, which no trace is")
        return pos, char, depth, state


def _brackets(data, depth, in_string, escape, scratch=None):
    """(positions, bytes, depth after) of each bracket outside strings in DATA, given the nesting state
    before it, and the state after it: (depth, inside a string, the next byte escaped)."""
    a = np.frombuffer(data, np.uint8)
    n = len(a)
    if not n:
        return np.zeros(0, np.int64), np.zeros(0, np.uint8), np.zeros(0, np.int64), (depth, in_string, escape)
    folded, mask, other = (scratch or _Scratch()).views(n)
    np.equal(a, ord('"'), out=mask)
    escape_after = False
    if escape or b"\\" in data:
        escaped, escape_after = _escaped(np.flatnonzero(a == ord("\\")), n, escape)
        mask[escaped] = False  # an escaped quote is text
    words = _string_bits(mask, in_string)
    np.bitwise_or(a, 0x20, out=folded)  # '[' -> '{', ']' -> '}'
    np.equal(folded, ord("{"), out=mask)
    np.equal(folded, ord("}"), out=other)
    np.logical_or(mask, other, out=mask)
    pos = np.flatnonzero(mask)
    pos = pos[_bit(words, pos) == 0]
    char = a[pos]
    depths = depth + np.cumsum(np.where((char | 0x20) == ord("{"), 1, -1))
    in_string_after = bool(_bit(words, np.array([n - 1]))[0])
    return pos, char, depths, (int(depths[-1]) if len(depths) else depth, in_string_after, escape_after)


class _Scratch:
    """The scan's byte-sized buffers, kept from chunk to chunk: fresh ones of a few MB each cost page
    faults that made up half the scan's time."""

    def __init__(self):
        self.size = 0

    def views(self, n):
        if n > self.size:
            self.size = n
            self.folded, self.mask, self.other = np.empty(n, np.uint8), np.empty(n, bool), np.empty(n, bool)
        return self.folded[:n], self.mask[:n], self.other[:n]


_ALL_ONES = np.uint64(0xFFFFFFFFFFFFFFFF)


def _string_bits(is_quote: np.ndarray, in_string: bool) -> np.ndarray:
    """Bit i (of 64-bit words) says whether byte i lies inside a string, its opening quote included:
    a prefix XOR of the quote bits, done within each word by shifts, then carried across words."""
    n = len(is_quote)
    words = np.zeros((n + 63) // 64, dtype="<u8")
    words.view(np.uint8)[:(n + 7) // 8] = np.packbits(is_quote, bitorder="little")
    for k in (1, 2, 4, 8, 16, 32):
        words ^= words << np.uint64(k)
    parity = np.bitwise_xor.accumulate((words >> np.uint64(63)).astype(np.uint8))  # after each word
    flip = np.empty(len(words), np.uint64)
    flip[0] = in_string
    flip[1:] = parity[:-1] ^ np.uint8(in_string)
    words ^= flip * _ALL_ONES
    return words


def _bit(words: np.ndarray, pos: np.ndarray) -> np.ndarray:
    return (words[pos >> 6] >> (pos & 63).astype(np.uint64)) & np.uint64(1)


class _Behind:
    """Reads backwards from FIRST + SECOND[:end] (the kept fields, then the chunk) without joining them;
    skipping whitespace costs what the whitespace is long, however long."""

    def __init__(self, first, second, end):
        self.first, self.second, self.end = first, second, len(first) + end

    def skip_space(self) -> None:
        while self.end > 0:
            start = max(self.end - 256, 0)
            piece = self._slice(start, self.end).rstrip(_JSON_SPACE)
            if piece:
                self.end = start + len(piece)
                return
            self.end = start

    def take(self, n) -> bytes:
        out = self._slice(max(self.end - n, 0), self.end)
        self.end -= len(out)
        return out

    def _slice(self, start, end) -> bytes:
        n = len(self.first)
        if end <= n:
            return bytes(self.first[start:end])
        if start >= n:
            return self.second[start - n:end - n]
        return bytes(self.first[start:]) + self.second[:end - n]


def _escaped(slashes: np.ndarray, size: int, carried: bool) -> tuple[np.ndarray, bool]:
    """Positions escaped by the backslash runs at SLASHES (an odd run escapes the next byte; CARRIED: the
    previous chunk ended on an odd run), and whether the last run escapes the next chunk's first byte."""
    if not len(slashes):
        return np.array([0]), False  # carried
    starts = np.flatnonzero(np.diff(slashes, prepend=-2) != 1)
    lengths = np.diff(np.append(starts, len(slashes)))
    after = slashes[starts] + lengths
    odd = lengths % 2 == 1
    if carried:
        if slashes[0] == 0:
            odd[0] = not odd[0]
        else:
            after, odd = np.append(0, after), np.append(True, odd)
    escaped = after[odd]
    if len(escaped) and escaped[-1] == size:
        return escaped[:-1], True
    return escaped, False


def _lstrip_space(data: bytes) -> bytes:
    """DATA without its leading JSON whitespace. bytes.lstrip() runs ~8x faster than lstrip(chars) but
    also takes \\v and \\f, which JSON does not: where it took one, strip again the strict way."""
    rest = data.lstrip()
    n = len(data) - len(rest)
    if n and (data.find(b"\x0b", 0, n) >= 0 or data.find(b"\x0c", 0, n) >= 0):
        return data.lstrip(_JSON_SPACE)
    return rest


# -- tables ---------------------------------------------------------------------------------------

ThreadKey = tuple[Union[int, str], Union[int, str]]  # an event's (pid, tid)


class TableBuilder:
    """Accumulates numpy columns per table from batches of events, then links them into a Trace."""

    def __init__(self, path: str):
        self.path = path
        self.parts: dict[str, list[dict]] = {"kernels": [], "memory": [], "cpu": [], "runtime": []}
        self.raw = RawInputs([], [], [], [])
        self.raw_seen: dict[bytes, bytes | None] = {}  # identical input records share one bytes object
        self.threads: dict[int, ThreadKey] = {}        # code -> (pid, tid)
        self.thread_index: dict[ThreadKey, int] = {}   # (pid, tid) -> code
        self.thread_names: dict[ThreadKey, str] = {}
        self.event_count = 0
        self.open_slices: dict[ThreadKey, list[TraceEvent]] = {}  # stack of "B" events waiting for their "E"
        self.ignored = {"ids": 0, "bytes": 0, "inputs": 0, "unopened": 0, "no_duration": 0}
        self.early = (0, 0.0)  # kernels that start before their launch, and by how much (µs)

    def add(self, events) -> None:
        self.event_count += len(events)
        complete = [e for e in events if e.ph == "X"]
        complete += self._other_events(events)
        self.parts["kernels"].append(self._gpu_columns([e for e in complete if e.cat in _KERNEL_CATS]))
        memory = [e for e in complete if e.cat in _MEMORY_CATS]
        cols = self._gpu_columns(memory)
        cols["bytes"] = self._bytes([e.args.bytes if e.args else None for e in memory])
        self.parts["memory"].append(cols)
        cpu = [e for e in complete if e.cat in _CPU_CATS]
        cpu_args = [e.args for e in cpu]
        self.parts["cpu"].append(self._cpu_columns(cpu, cpu_args))
        self._keep_inputs(cpu, cpu_args)
        runtime = [e for e in complete if e.cat in _RUNTIME_CATS]
        self.parts["runtime"].append(self._runtime_columns(runtime))
        for part in self.parts.values():
            self._check_times(part[-1])

    def _other_events(self, events) -> list:
        """Thread names from "M" events; Chrome's duration events paired: each "E" closes the latest
        open "B" of its thread into a complete event, returned."""
        paired = []
        for e in events:
            if e.ph not in _NAME_OR_SLICE:
                continue
            if e.ph == "M":
                if e.name == "thread_name" and e.args is not None and e.args.name:
                    # Kineto's are "thread 711 (pt_gloo_runner)"; shown in findings, never keyed on
                    self.thread_names[(e.pid, e.tid)] = e.args.name[:256]
            elif e.ph == "B":
                self.open_slices.setdefault((e.pid, e.tid), []).append(e)
            elif stack := self.open_slices.get((e.pid, e.tid)):
                begin = stack.pop()
                paired.append(msgspec.structs.replace(begin, ph="X", dur=_float(e.ts) - _float(begin.ts),
                                                      args=begin.args or e.args))
            else:
                self.ignored["unopened"] += 1
        return paired

    def _check_times(self, cols) -> None:
        ts, dur = cols["ts"], cols["dur"]
        if not (np.isfinite(ts).all() and np.isfinite(dur).all()):
            raise TraceError(f"{self.path}: an event's ts or dur is not a finite number of microseconds")
        if len(dur) and dur.min() < 0:
            raise TraceError(f"{self.path}: negative event duration ({dur.min():g} us)")
        if len(dur) and dur.max() > _MAX_DURATION_US:
            raise TraceError(f"{self.path}: an event lasts {dur.max():.3g} us, over a day: a corrupt duration")

    def _thread_codes(self, evs) -> np.ndarray:
        """Each event's thread code; new (pid, tid) pairs numbered in order of appearance."""
        pids, tids = [e.pid for e in evs], [e.tid for e in evs]
        pid, tid = np.array(pids), np.array(tids)
        if pid.dtype.kind == tid.dtype.kind == "i":  # integers within 64 bits, not names: hashed by pandas
            pid_codes, _ = pd.factorize(pid)
            tid_codes, tid_values = pd.factorize(tid)
            local, _ = pd.factorize(pid_codes * len(tid_values) + tid_codes)
        else:
            first: dict = {}
            local = np.array([first.setdefault(key, len(first)) for key in zip(pids, tids)], dtype=np.int64)
        index, threads = self.thread_index, self.threads
        codes = []
        for i in np.unique(local, return_index=True)[1].tolist():  # each pair's first event, in order
            key = (pids[i], tids[i])
            if key not in index:
                index[key] = len(threads)
                threads[index[key]] = key
            codes.append(index[key])
        return np.array(codes, dtype=np.int64)[local]

    def _gpu_columns(self, evs) -> dict:
        args = [e.args for e in evs]
        return {
            "name": _names([e.name for e in evs]),
            "ts": _num([e.ts for e in evs]),
            "dur": _num([e.dur for e in evs]),
            # Kineto files a GPU activity under pid = device, tid = stream; a peer-to-peer copy's args name no device
            "stream": self._ids([a.stream if a and a.stream is not None else (e.tid if isinstance(e.tid, int) else None)
                                 for e, a in zip(evs, args)]),
            "device": self._ids([a.device if a and a.device is not None else (e.pid if isinstance(e.pid, int) else None)
                                 for e, a in zip(evs, args)]),
            "correlation": self._ids([a.correlation if a else None for a in args]),
            "external_id": self._ids([a.external_id if a else None for a in args]),
        }

    def _cpu_columns(self, evs, args) -> dict:
        return {
            "cat": _objects_array([_CPU_CATS[e.cat] for e in evs]),
            "name": _names([e.name for e in evs]),
            "ts": _num([e.ts for e in evs]),
            "dur": _num([e.dur for e in evs]),
            "thread": self._thread_codes(evs),
            "external_id": self._ids([a.external_id if a else None for a in args]),
            "seq": self._ids([a.sequence_number if a else None for a in args]),
        }

    def _runtime_columns(self, evs) -> dict:
        args = [e.args for e in evs]
        return {
            "name": _names([e.name for e in evs]),
            "ts": _num([e.ts for e in evs]),
            "dur": _num([e.dur for e in evs]),
            "thread": self._thread_codes(evs),
            "correlation": self._ids([a.correlation if a else None for a in args]),
            "external_id": self._ids([a.external_id if a else None for a in args]),
        }

    def _ids(self, values) -> np.ndarray:
        """Integer ids, -1 where absent; ids beyond 64 bits (corrupt) count as absent, with a warning."""
        try:
            try:
                return np.array(values, dtype=np.int64)  # none absent: no pass in Python
            except TypeError:
                return np.array([-1 if v is None else v for v in values], dtype=np.int64)
        except OverflowError:
            kept = [-1 if v is None or not -(1 << 63) <= v < (1 << 63) else v for v in values]
            self.ignored["ids"] += sum(v is not None and k == -1 for v, k in zip(values, kept))
            return np.array(kept, dtype=np.int64)

    def _bytes(self, values) -> np.ndarray:
        """A copy's byte count, NaN where absent; negative or beyond 2**53 (corrupt) too, with a warning."""
        out = _num([np.nan if v is None else v for v in values])
        bad = ~((out >= 0) & (out < 2.0 ** 53)) & ~np.isnan(out)
        self.ignored["bytes"] += int(bad.sum())
        out[bad] = np.nan
        return out

    def _keep_inputs(self, evs, args) -> None:
        """The ops' recorded inputs as raw JSON bytes, deduplicated (shapes repeat every step); records with
        numbers no tensor has are dropped, with a warning, before any detector multiplies them."""
        # An op's four fields as one bytes key (JSON has no raw control bytes): the per-event work is
        # one join and a few lookups, the rest runs per distinct record.
        records: list = [_SEP.join((a.input_dims, a.input_types, a.input_strides, a.concrete_inputs))
                         if a else _NO_INPUTS for a in args]
        distinct: list = list(dict.fromkeys(records))
        parts = [record.split(_SEP) for record in distinct]
        if any(len(p) != 4 for p in parts):  # a byte 1 in a string msgspec skipped: tuples instead
            records = [(bytes(a.input_dims), bytes(a.input_types), bytes(a.input_strides), bytes(a.concrete_inputs))
                       if a else (b"",) * 4 for a in args]
            distinct = list(dict.fromkeys(records))
            parts = distinct
        seen = self.raw_seen
        for field, (column, sane) in enumerate(((self.raw.dims, _sane_dims), (self.raw.types, None),
                                                (self.raw.strides, _sane_strides), (self.raw.concrete, None))):
            # each distinct record is checked once, in event order
            for key in dict.fromkeys(p[field] for p in parts):
                if key and key not in seen:
                    try:
                        key.decode()  # msgspec skips raw JSON without checking its strings
                    except UnicodeDecodeError:
                        first = next(r for r, p in zip(distinct, parts) if p[field] == key)
                        name = evs[records.index(first)].name
                        raise TraceError(f"{self.path}: invalid UTF-8 in the recorded inputs of {name[:80]!r}") from None
                    seen[key] = key if sane is None or sane(key) else None
            kept = {r: seen[p[field]] if p[field] else None for r, p in zip(distinct, parts)}
            column.extend(map(kept.__getitem__, records))
            dropped = {r for r, p in zip(distinct, parts) if p[field] and kept[r] is None}
            if dropped:
                self.ignored["inputs"] += sum(1 for r in records if r in dropped)

    def _check_gpu_within_host(self, kernels, cpu, runtime) -> None:
        """A kernel that ends long after the host's last event (an hour in a trace whose host side spans 20 ms) has
        a corrupt duration: every figure of the step would be its."""
        host = [t for t in (cpu, runtime) if len(t)]
        if len(kernels) and host:
            start = min(float(t["ts"].min()) for t in host)
            end = max(float(t["end"].max()) for t in host)
            late = kernels["end"].to_numpy() > end + max(_KERNEL_AFTER_HOST_US, _KERNEL_AFTER_HOST_SPANS * (end - start))
            if late.any():
                worst = kernels.iloc[int(np.argmax(kernels["end"].to_numpy()))]
                raise TraceError(f"{self.path}: kernel {str(worst['name'])[:80]!r} ends "
                                 f"{(float(worst['end']) - end) / 1e6:.3g} s after the host's last event, in a trace "
                                 f"whose host side spans {(end - start) / 1e3:.3g} ms: a corrupt duration")

    def warnings(self) -> list[str]:
        unclosed = sum(len(stack) for stack in self.open_slices.values())
        found = {
            "ids": "ids (External id, correlation, Sequence number, stream, device) beyond 64 bits ignored",
            "bytes": "memcpy/memset byte counts out of range ignored",
            "inputs": "ops' recorded shapes or strides with numbers no tensor has ignored",
            "unopened": "'E' events without a 'B' on their thread ignored",
            "no_duration": "kernels without a duration (or of 0 µs) count as taking no time",
        }
        out = [f"{count} {found[key]}" for key, count in self.ignored.items() if count]
        if unclosed:
            out.append(f"{unclosed} 'B' events without an 'E' on their thread ignored")
        count, most = self.early
        if count:
            out.append(f"{count} kernels start before the host call that launched them (by up to {most / 1e3:.3g} ms): "
                       "the GPU's clock is behind the host's in this trace, and what places kernels against host "
                       "time (steps, idle gaps, the replay) is off by as much")
        return out

    def finish(self, metadata: dict) -> Trace:
        if not self.event_count:
            raise TraceError(f"{self.path}: holds no events")
        kernels, memory, cpu, runtime = (_frame(self.parts[name]) for name in ("kernels", "memory", "cpu", "runtime"))
        self.parts.clear()  # the frames hold the columns now
        if not (len(kernels) or len(memory) or len(cpu) or len(runtime)):
            raise TraceError(f"{self.path}: none of its {self.event_count} events is a torch.profiler event "
                             "(complete or B/E events of category kernel, cpu_op, cuda_runtime, ...)")
        kernels["kind"] = pd.Series(kernel_kinds(kernels["name"].to_numpy()), dtype=object)
        _number_device_streams(kernels, memory)
        origin = _origin(kernels, memory, cpu, runtime)
        for table in (kernels, memory, cpu, runtime):
            table["ts"] -= origin
            table["end"] = table["ts"] + table["dur"]
        span = max(float(t["end"].max()) for t in (kernels, memory, cpu, runtime) if len(t))
        if span > _MAX_DURATION_US:
            raise TraceError(f"{self.path}: its events span {span / 86400e6:.3g} days, which no profile does: "
                             "a corrupt timestamp")
        self._check_gpu_within_host(kernels, cpu, runtime)
        self.early = _launched_later(kernels, runtime)
        self.ignored["no_duration"] += int((kernels["dur"].to_numpy() == 0).sum())  # read as 0 µs: a warning says so
        # The capture agent writes its module labels as cheap cpu_op ranges; they are annotations.
        if len(cpu):
            is_label = name_mask(cpu, lambda n: n.startswith(labels.MODULE_PREFIX))
            cat = np.where(is_label, "user_annotation", cpu["cat"].to_numpy())
            cpu["cat"] = pd.Series(cat, dtype=object, index=cpu.index)  # object, as built: no Arrow strings
        _link_cpu_tree(cpu)
        _attribute_backward(cpu)
        op_rows = _rows_by_external_id(cpu)
        for table in (runtime, kernels, memory):  # runtime first: kernels without an External id go through it
            table["op"] = _lookup(op_rows, table["external_id"].to_numpy())
            missing = table["op"].to_numpy() < 0
            if missing.any() and table is not runtime and len(runtime):
                via_launch = pd.Series(runtime["op"].to_numpy(), index=runtime["correlation"].to_numpy())
                via_launch = via_launch[~via_launch.index.duplicated()]
                found = via_launch.reindex(table["correlation"].to_numpy()).fillna(-1).astype(np.int64).to_numpy()
                table.loc[missing, "op"] = found[missing]
        _add_op_context(kernels, cpu)
        _add_op_context(memory, cpu)
        names = {self.thread_index[key]: name for key, name in self.thread_names.items() if key in self.thread_index}
        base = metadata.get("baseTimeNanoseconds")
        start = origin + (base / 1e3 if type(base) is int and 0 <= base < 1 << 62 else 0.0)
        return Trace(path=self.path, rank=named_rank(metadata), metadata=metadata,
                     device=device_from_properties(metadata.get("deviceProperties")),
                     kernels=kernels, memory=memory, cpu=cpu, runtime=runtime, raw_inputs=self.raw,
                     event_count=self.event_count, threads=self.threads, thread_names=names,
                     warnings=self.warnings(), clock_span=(start, start + span))


_MAX_ELEMENTS = 1 << 62


def _sane_dims(raw: bytes) -> bool:
    """Input Dims: every tensor's sizes non-negative, its element count within 2**62."""
    return _all_int_lists(raw, lambda ints: min(ints) >= 0 and math.prod(ints) <= _MAX_ELEMENTS)


def _sane_strides(raw: bytes) -> bool:
    return _all_int_lists(raw, lambda ints: max(abs(min(ints)), abs(max(ints))) <= _MAX_ELEMENTS)


def _all_int_lists(raw: bytes, check) -> bool:
    """Whether CHECK holds for every list of integers nested in the JSON RAW (floats and strings pass:
    the model reads only integer lists as shapes)."""
    try:
        stack = [ANY_DECODER.decode(raw)]
    except (msgspec.DecodeError, RecursionError):
        return False
    while stack:
        value = stack.pop()
        if not isinstance(value, list):
            continue
        ints = [v for v in value if type(v) is int]
        if ints and not check(ints):
            return False
        stack.extend(v for v in value if isinstance(v, list))
    return True


def _float(value) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond float range: infinity, which the range checks refuse
        return math.inf if value > 0 else -math.inf


def _launched_later(kernels: pd.DataFrame, runtime: pd.DataFrame) -> tuple[int, float]:
    """(kernels that start before their launch call, the most by which one does, µs). A launch takes 5 µs or more
    to reach the GPU on every bundled trace; a kernel ahead of its launch is on a clock offset from the host's."""
    if not len(kernels) or not len(runtime):
        return 0, 0.0
    ahead = launch_times(runtime, kernels["correlation"].to_numpy()) - kernels["ts"].to_numpy()
    ahead = ahead[ahead > 0]
    return int(len(ahead)), float(ahead.max()) if len(ahead) else 0.0


def _number_device_streams(kernels: pd.DataFrame, memory: pd.DataFrame) -> None:
    """Each row's "device_stream": a code for its (device, stream), in their order. A stream belongs to its device,
    and one process driving two GPUs runs a stream 7 on each."""
    pairs = np.concatenate([np.column_stack([t["device"].to_numpy(np.int64), t["stream"].to_numpy(np.int64)])
                            for t in (kernels, memory)]).reshape(-1, 2)
    codes = np.unique(pairs, axis=0, return_inverse=True)[1].reshape(-1) if len(pairs) else np.zeros(0, np.int64)
    kernels["device_stream"] = codes[:len(kernels)].astype(np.int64)
    memory["device_stream"] = codes[len(kernels):].astype(np.int64)


def _frame(parts: list) -> pd.DataFrame:
    columns = {}
    for key in parts[0]:
        arrays = [p[key] for p in parts]
        joined = np.concatenate(arrays) if arrays else np.zeros(0)
        columns[key] = pd.Series(joined, dtype=object) if joined.dtype == object else joined
    return pd.DataFrame(columns)


def _num(values) -> np.ndarray:
    try:
        return np.array(values, dtype=np.float64)
    except OverflowError:
        return np.array([_float(v) for v in values], dtype=np.float64)


def _names(values) -> np.ndarray:
    """Names as one shared str object each (a million kernels have a few hundred names)."""
    out = np.empty(len(values), dtype=object)
    out[:] = [sys.intern(v) for v in values]
    return out


def _objects_array(values) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _objects(values) -> pd.Series:
    """An object column: pandas 3 would otherwise infer Arrow strings, slow to iterate row by row."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return pd.Series(out, dtype=object)


def _origin(*tables) -> float:
    starts = [t["ts"].min() for t in tables if len(t)]
    return float(min(starts)) if starts else 0.0


def _link_cpu_tree(cpu: pd.DataFrame) -> None:
    """parent (row of the innermost enclosing CPU event on the same thread), module label, top-level op."""
    n = len(cpu)
    if not n:
        for column in ("order", "parent", "module", "top"):
            cpu[column] = _objects([]) if column == "module" else np.zeros(0, dtype=np.int64)
        cpu["outermost"] = np.zeros(0, dtype=bool)
        cpu["backward"] = False
        return
    thread, ts = cpu["thread"].to_numpy(), cpu["ts"].to_numpy()
    # parents first: by thread, then start, then longest first
    order = np.lexsort((-cpu["dur"].to_numpy(), ts, thread))
    start, end, thread = ts[order], cpu["end"].to_numpy()[order], thread[order]
    # In that order an event's parent is the latest earlier one on its thread still open at its start
    # (what a stack sweep finds); each candidate that ended jumps to its own candidate, in rounds.
    candidate = np.arange(-1, n - 1)
    candidate[np.flatnonzero(thread[1:] != thread[:-1]) + 1] = -1
    todo = np.flatnonzero(candidate >= 0)
    for _ in range(_LINK_ROUNDS):
        if not len(todo):
            break
        c = candidate[todo]
        ended = end[c] <= start[todo]
        todo, c = todo[ended], c[ended]
        candidate[todo] = candidate[c]
        todo = todo[candidate[todo] >= 0]
    # Real traces need ~20 rounds; a hostile nest could need one per level. The rest is the sweep itself,
    # in order: from the previous event up through parents, skipping what the stack would pop (linear).
    for i in todo.tolist():
        j = i - 1
        while j >= 0 and end[j] <= start[i]:
            j = int(candidate[j])
        candidate[i] = j
    parent = np.full(n, -1, dtype=np.int64)
    parent[order] = np.where(candidate >= 0, order[np.maximum(candidate, 0)], -1)
    codes, names = pd.factorize(cpu["name"].to_numpy())
    own = _objects([_module_of(name) for name in names]).to_numpy()[codes]
    is_op = (cpu["cat"] == "cpu_op").to_numpy()
    top_seed = is_op & ((parent < 0) | ~is_op[np.maximum(parent, 0)])
    cpu["order"] = _inverse(order)  # position in parent-first order
    cpu["parent"] = parent
    cpu["module"] = _objects(_inherit(own, parent))
    cpu["top"] = _nearest(parent, top_seed)
    # an op no op encloses, through annotations too (a compiled region's kernels' ops sit under its "## Call
    # CompiledFxGraph" range): the host time outermost ops sum is the host's, counted once
    nearest_op = _nearest(parent, is_op)
    cpu["outermost"] = is_op & ((parent < 0) | (nearest_op[np.maximum(parent, 0)] < 0))
    cpu["backward"] = False


def _inverse(permutation: np.ndarray) -> np.ndarray:
    out = np.empty(len(permutation), dtype=np.int64)
    out[permutation] = np.arange(len(permutation))
    return out


def _nearest(parent: np.ndarray, has: np.ndarray) -> np.ndarray:
    """Each row's nearest of itself and its ancestors where HAS holds, -1 if none: pointer jumping,
    so as many rounds as the log of the depth."""
    found = np.where(has, np.arange(len(has)), -1)
    up = np.where(has, -1, parent)
    todo = np.flatnonzero(up >= 0)
    while len(todo):
        a = up[todo]
        found[todo] = found[a]
        up[todo] = up[a]
        todo = todo[(found[todo] < 0) & (up[todo] >= 0)]
    return found


def _inherit(values: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """VALUES (an object array), None replaced by the nearest ancestor's value."""
    source = _nearest(parent, pd.notna(values))
    out = np.full(len(values), None, dtype=object)
    has = source >= 0
    out[has] = values[source[has]]
    return out


def _module_of(name):
    """Module of a CPU event: our capture label, or torch's own `nn.Module: Class_N` python frame
    (with_stack/with_modules), which names the class but not the path."""
    if name.startswith(labels.MODULE_PREFIX):
        parsed = labels.parse_module_label(name)
        return f"{parsed[0]} ({parsed[1]})" if parsed else None
    if name.startswith("nn.Module: "):
        instance = name[len("nn.Module: "):]
        cls = instance.rsplit("_", 1)[0] if instance.rsplit("_", 1)[-1].isdigit() else instance
        return f"{instance} ({cls})"
    return None


def _attribute_backward(cpu: pd.DataFrame) -> None:
    """Backward ops inherit the module of the forward op that made their autograd node (sequence number)."""
    bwd = name_mask(cpu, lambda n: n.startswith("autograd::engine::evaluate_function"))
    if not bwd.any():
        return
    seq = cpu["seq"].to_numpy()
    fwd = (~bwd) & (seq >= 0) & cpu["module"].notna().to_numpy()
    fwd_module = pd.Series(cpu["module"].to_numpy()[fwd], index=seq[fwd])
    fwd_module = fwd_module[~fwd_module.index.duplicated(keep="last")]  # innermost op records last
    module = cpu["module"].to_numpy().copy()
    roots = np.flatnonzero(bwd)
    found = fwd_module.reindex(seq[roots]).to_numpy()
    for row, label in zip(roots.tolist(), found.tolist()):
        if module[row] is None and isinstance(label, str):
            module[row] = label
    # a backward node's descendants are backward, and take its module where they have none
    parent = cpu["parent"].to_numpy()
    cpu["module"] = pd.Series(_inherit(module, parent), dtype=object, index=cpu.index)
    cpu["backward"] = _nearest(parent, bwd) >= 0


def _rows_by_external_id(cpu: pd.DataFrame) -> pd.Series:
    ops = cpu[(cpu["cat"] == "cpu_op") & (cpu["external_id"] >= 0)]
    rows = pd.Series(ops.index.to_numpy(), index=ops["external_id"].to_numpy())
    return rows[~rows.index.duplicated(keep="first")]


def _lookup(rows: pd.Series, keys: np.ndarray) -> np.ndarray:
    if not len(keys):
        return np.zeros(0, dtype=np.int64)
    return rows.reindex(keys).fillna(-1).astype(np.int64).to_numpy()


def _add_op_context(table: pd.DataFrame, cpu: pd.DataFrame) -> None:
    """Name of the launching op, its top-level op and module, copied onto each GPU row."""
    op = table["op"].to_numpy()
    has = op >= 0
    if not len(cpu):
        for col in ("op_name", "top_op_name", "module"):
            table[col] = _objects([None] * len(op))
        table["top_op"] = np.full(len(op), -1, dtype=np.int64)
        table["backward"] = np.zeros(len(op), dtype=bool)
        return
    safe = np.where(has, op, 0)
    names = cpu["name"].to_numpy()
    top = np.where(has, cpu["top"].to_numpy()[safe], -1)
    table["op_name"] = pd.Series(np.where(has, names[safe], None), dtype=object, index=table.index)
    table["top_op"] = top
    table["top_op_name"] = pd.Series(np.where(top >= 0, names[np.maximum(top, 0)], None), dtype=object, index=table.index)
    # numpy's stubs read where(c, x, None) as the one-argument form (a tuple of indices) when x is untyped
    module: np.ndarray = np.where(has, cpu["module"].to_numpy()[safe], None)  # type: ignore[assignment]
    if not has.all():
        module = np.where(has, module, _module_by_label_id(cpu, table["external_id"].to_numpy()))
    table["module"] = pd.Series(module, dtype=object, index=table.index)
    table["backward"] = np.where(has, cpu["backward"].to_numpy()[safe], False)


def _module_by_label_id(cpu: pd.DataFrame, external_ids: np.ndarray) -> np.ndarray:
    """Module of the label whose External id a launch carries: a Triton kernel launched straight
    from a module's Python code has no aten op, and then Kineto gives it the agent's label's id."""
    is_label = (cpu["cat"] == "user_annotation").to_numpy() & cpu["module"].notna().to_numpy() \
        & (cpu["external_id"] >= 0).to_numpy()
    by_id = pd.Series(cpu["module"].to_numpy()[is_label], index=cpu["external_id"].to_numpy()[is_label])
    by_id = by_id[~by_id.index.duplicated()]
    return _none_where_missing(by_id.reindex(external_ids))


def _none_where_missing(column: pd.Series) -> np.ndarray:
    """An object column's values with None, never NaN (truthy, and unorderable against str), where absent:
    reindex() and friends fill with NaN."""
    values = column.to_numpy(dtype=object, copy=True)
    values[column.isna().to_numpy()] = None
    return values


# ranks a trace may name: a job of up to 2^20 processes (what the pages take, and a 32-bit column holds)
MAX_RANK = (1 << 20) - 1


def named_rank(metadata):
    """The rank the trace names (capture's metadata, else torch.distributed's), or None where it names none that
    could be one (not a whole number in 0..MAX_RANK)."""
    return _named_int(metadata, "rank", 0, MAX_RANK)


def named_world_size(metadata):
    """The job's rank count as the trace names it (the same places), or None where it names none in 2..MAX_RANK+1."""
    return _named_int(metadata, "world_size", 2, MAX_RANK + 1)


def _named_int(metadata, field_name: str, low: int, high: int):
    for key in (labels.METADATA_KEY, "distributedInfo"):
        info = metadata.get(key)
        value = info.get(field_name) if isinstance(info, dict) else None
        if type(value) is int and low <= value <= high:
            return value
    return None
