"""The dashboard for a WSGI server: `gunicorn profiler_svc.web.wsgi:app` (or waitress, mod_wsgi).

A start-up error (a PostgreSQL database behind the code or out of reach) is one line on stderr, as the commands
print it, not the server's traceback. The exit status is 4, gunicorn's "the app failed to load": its arbiter then
stops instead of starting workers that fail the same way.
"""
import sys

from ..errors import UserError
from ..formats import error_line
from . import create_app

try:
    app = create_app()
except UserError as exc:
    print(error_line(exc), file=sys.stderr)
    sys.exit(4)
