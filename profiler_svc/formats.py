"""How values are shown to people and written as JSON: one home for each format.

Imports nothing of profiler_svc, so every layer (detectors, storage, the web app) can use it.
"""
import math
import re


def fmt_us(us) -> str:
    """Microseconds for people: 950.0 µs, 12.30 ms, 4.56 s ("–" for no value)."""
    if us is None:
        return "–"
    us = float(us)
    if abs(us) < 0.05:
        us = 0.0  # no "-0.0 µs"
    if abs(us) >= 1e6:
        return f"{us / 1e6:.2f} s"
    if abs(us) >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"


def reference_note(row: dict) -> str:
    """One line for a row of an A/B result's `reference_fallbacks`: where the fp64 reference ran otherwise (an op
    in a lower precision, parity on part of the batch, an MoE's choices taken from the run it judges)."""
    if "note" in row:
        return f"{row.get('op', '?')}: {row['note']}"
    return f"{row.get('op', '?')} has no float64 kernel here; ran it in {row.get('dtype', '?')}"


def one_line(exc: BaseException) -> str:
    """`TypeError: first line of the message`: an exception as one line for the user."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


def plain_json(value):
    """Plain JSON data: numpy scalars and arrays as Python values, NaN and infinities as null
    (JSON has none; PostgreSQL's json type refuses them), dict keys as strings, tuples as lists,
    anything else unknown as its string."""
    if isinstance(value, dict):
        return {str(key): plain_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(item) for item in value]
    if isinstance(value, float):  # numpy's float64 too, a float subclass
        return float(value) if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return plain_json(value.tolist())
    return str(value)


_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f\x9b]")


def error_line(exc: BaseException) -> str:
    """A user error as the commands print it to stderr: one line, whatever a path or name in it holds."""
    return f"profiler_svc: error: {clean(str(exc).replace(chr(10), ' '))}"


def clean(text) -> str:
    """One line without terminal control characters: a hostile kernel name or path must not drive the terminal,
    nor start a line of its own (a forged finding, a broken table row)."""
    return _CONTROL.sub("?", str(text))


def clean_lines(text) -> str:
    """clean() line by line: text whose line breaks are ours (a fix's code)."""
    return "\n".join(clean(line) for line in str(text).splitlines())
