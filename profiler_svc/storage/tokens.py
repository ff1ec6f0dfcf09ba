"""API tokens: several per deployment, each revocable; only a token's SHA-256 is stored.

A token is 32 random bytes (``secrets.token_urlsafe``), so a plain SHA-256 is enough to make the
stored value useless to whoever reads the database (no password-style stretching needed).
"""
import hashlib
import secrets
from datetime import timedelta

from sqlalchemy import select, update

from ..errors import UserError
from .models import APIToken, utcnow, valid_utf8
from .queries import get, iso_utc

PREFIX = "psvc_"  # recognisable in a leaked log or config file
_LAST_USED_EVERY = timedelta(minutes=5)  # at most one write per token per 5 minutes


def digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "replace")).hexdigest()


def create(session, name: str) -> tuple[APIToken, str]:
    """A new token: its row, and the token itself (shown once, never stored)."""
    name = valid_utf8(name or "").replace("\x00", "").strip()  # e.g. a non-UTF-8 command-line argument
    if not name or len(name) > 255:
        raise UserError("a token needs a name of 1 to 255 characters (who or what uses it)")
    token = PREFIX + secrets.token_urlsafe(32)
    row = APIToken(name=name, token_sha256=digest(token))
    session.add(row)
    session.flush()
    return row, token


def verify(session, token: str) -> APIToken | None:
    """The live (not revoked) token row for this token, or None."""
    if not token or len(token) > 200:
        return None
    row = session.scalars(select(APIToken).where(APIToken.token_sha256 == digest(token),
                                                 APIToken.revoked_at.is_(None))).first()
    if row is not None:
        touch(session, row)
    return row


def live(session, token_id: int) -> APIToken | None:
    """The token row behind a signed-in session, if it was not revoked since."""
    row = session.get(APIToken, token_id) if isinstance(token_id, int) and 0 < token_id < 2**31 else None
    return row if row is not None and row.revoked_at is None else None


def touch(session, row: APIToken) -> None:
    now = utcnow()
    last = row.last_used_at
    if last is not None and last.tzinfo is None:  # SQLite gives naive datetimes back
        last = last.replace(tzinfo=now.tzinfo)
    if last is None or now - last > _LAST_USED_EVERY:
        session.execute(update(APIToken).where(APIToken.id == row.id).values(last_used_at=now))


def revoke(session, token_id: int) -> APIToken:
    row = get(session, APIToken, token_id)
    if row.revoked_at is not None:
        raise UserError(f"token {token_id} ({row.name}) was revoked already")
    row.revoked_at = utcnow()
    return row


def listing(session) -> list[dict]:
    return [{"id": t.id, "name": t.name, "created_at": iso_utc(t.created_at),
             "last_used_at": iso_utc(t.last_used_at),
             "revoked_at": iso_utc(t.revoked_at)}
            for t in session.scalars(select(APIToken).order_by(APIToken.id))]

