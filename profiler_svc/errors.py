"""User-facing errors: the CLI prints these as one line and exits 2, never with a traceback."""


class UserError(Exception):
    """Bad input or configuration that the user can fix; the message is one complete line."""


class TraceError(UserError):
    """A trace file or folder that cannot be read as a Kineto/Chrome trace."""
