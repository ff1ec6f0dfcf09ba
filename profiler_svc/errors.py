"""User-facing errors: the CLI prints these as one line and exits 2, never with a traceback."""


class UserError(Exception):
    """Bad input or configuration that the user can fix; the message is one complete line."""


class TraceError(UserError):
    """A trace file or folder that cannot be read as a Kineto/Chrome trace."""


def setting_int(environ, name: str, default: int, minimum: int = 1) -> int:
    """A whole-number setting from the environment (ENVIRON: os.environ), at least MINIMUM; a bad value is a
    UserError naming the setting, not a traceback."""
    text = environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{name}={text[:40]!r} is not a whole number") from None
    if value < minimum:
        raise UserError(f"{name}={value} is below its least value, {minimum}")
    return value
