"""The web console, served by the admin listener, and the browser sessions it runs on.

    GET  /console                    redirects to /console/
    GET  /console/                   the page (static, no data, no credentials needed)
    GET  /console/{file}             its stylesheet and script
    POST /console/login              an operator token for a session cookie and a CSRF token
    GET  /console/session            the session's operator, role and CSRF token   viewer
    POST /console/logout             end the session                               viewer

The page holds no data: it reads the JSON API and the event stream like any client. A browser
is not given the operator's token to keep: the login form sends it once, in a JSON body, and
gets back a cookie (``HttpOnly``, ``SameSite=Strict``, ``Path=/``; ``Secure`` over HTTPS)
naming a random session kept here (at most ``MAX_SESSIONS``, each for ``SESSION_TTL``). The
session keeps the SHA-256 of the token, not the token: removing an operator or giving them a
new token ends their sessions, and a changed role applies to the next request.

A request is authenticated by its ``Authorization: Bearer`` header if it has one (API clients;
browsers never add it on their own, so it needs no CSRF protection), else by the session
cookie. With the cookie, a state-changing request must carry the session's CSRF token in
``X-CSRF-Token``, and is refused when ``Origin`` names another host or ``Sec-Fetch-Site`` is
anything but ``same-origin`` (when the browser sends them). ``EventSource`` cannot send
headers: it uses the cookie, on a GET, which changes nothing.

Cookies are kept per host, not per port: another service on the same host name that an
operator's browser visits receives the session cookie too (it still cannot change anything
without the CSRF token, and the Origin check names the port). Give the admin listener a host
name of its own, or reach it through an SSH tunnel, rather than sharing a host name with
services you do not trust.

Every answer of the admin listener (page, API, event stream, refusal) carries a strict
Content-Security-Policy (scripts, styles and connections from the listener itself only; no
inline script or style; no framing), ``X-Content-Type-Options: nosniff`` and
``Referrer-Policy: no-referrer``; data answers are ``Cache-Control: no-store``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from gateway.operators import Operator, OperatorBook, token_digest

CONSOLE_DIR = Path(__file__).resolve().parent / "console"
FILES = {
    "index.html": "text/html; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
}
SESSION_COOKIE = "capgate_session"
CSRF_HEADER = "X-CSRF-Token"
SESSION_TTL = 8 * 3600.0
MAX_SESSIONS = 256
MAX_TOKEN = 256
SAFE_METHODS = frozenset({"GET", "HEAD"})
RECHECK_S = 5.0  # how often an open event stream checks that its operator may still see it

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


class Refused(Exception):
    """Raised when a console request is refused before it reaches its handler; the admin
    API answers it as problem+json."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class Session:
    key: str  # SHA-256 of the session id (the id itself is only in the cookie)
    digest: str  # SHA-256 of the operator's token
    csrf: str
    expires: float


class Sessions:
    """Console sessions of this listener, bounded in number and lifetime. When full, the
    session closest to its end makes room for the new one."""

    def __init__(
        self,
        ttl: float = SESSION_TTL,
        capacity: int = MAX_SESSIONS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.capacity = capacity
        self.clock = clock
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    @staticmethod
    def _key(session_id: str) -> str:
        return hashlib.sha256(session_id.encode("utf-8", "surrogateescape")).hexdigest()

    def open(self, token_sha256: str) -> tuple[str, Session]:
        """A new session for the operator whose token has this digest: (its id, the session)."""
        now = self.clock()
        for key in [k for k, s in self._sessions.items() if s.expires <= now]:
            del self._sessions[key]
        while len(self._sessions) >= self.capacity:
            oldest = min(self._sessions.values(), key=lambda s: s.expires)
            del self._sessions[oldest.key]
        session_id = secrets.token_urlsafe(32)
        session = Session(
            key=self._key(session_id),
            digest=token_sha256,
            csrf=secrets.token_urlsafe(32),
            expires=now + self.ttl,
        )
        self._sessions[session.key] = session
        return session_id, session

    def get(self, session_id: str) -> Session | None:
        if not session_id or len(session_id) > 128:
            return None
        key = self._key(session_id)
        session = self._sessions.get(key)
        if session is None:
            return None
        if session.expires <= self.clock():
            del self._sessions[key]
            return None
        return session

    def alive(self, session: Session) -> bool:
        return self._sessions.get(session.key) is session and session.expires > self.clock()

    def close(self, session: Session) -> None:
        self._sessions.pop(session.key, None)

    def remaining(self, session: Session) -> int:
        return max(0, round(session.expires - self.clock()))


SESSIONS: web.AppKey[Sessions] = web.AppKey("console_sessions", Sessions)
SESSION: web.RequestKey[Session] = web.RequestKey("console_session", Session)
WHO: web.RequestKey[Operator] = web.RequestKey("console_operator", Operator)
CHECKED: web.RequestKey[float] = web.RequestKey("console_checked", float)


def _cross_site(request: web.Request) -> str | None:
    """Why this browser request comes from another site, or None. Browsers send
    ``Sec-Fetch-Site`` and ``Origin`` on a POST; API clients usually send neither."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site != "same-origin":
        return f"a {site} request may not act with a console session"
    origin = request.headers.get("Origin")
    if origin is not None and (origin == "null" or urlsplit(origin).netloc != request.host):
        return "the request's Origin is not this console"
    return None


def identify(request: web.Request, book: OperatorBook) -> Operator | None:
    """The operator a request speaks for: its Bearer header if it has one, else its console
    session (with the CSRF checks for a state-changing request, which raise ``Refused``)."""
    authorization = request.headers.get("Authorization")
    if authorization is not None:
        found = book.authenticate(authorization)
        if found is not None:
            request[WHO] = found
        return found
    sessions = request.app[SESSIONS]
    session = sessions.get(request.cookies.get(SESSION_COOKIE, ""))
    if session is None:
        return None
    operator = book.by_digest(session.digest)
    if operator is None:  # removed, or given a new token
        sessions.close(session)
        return None
    if request.method not in SAFE_METHODS:
        why = _cross_site(request)
        if why is not None:
            raise Refused(403, "cross_site_refused", why)
        presented = request.headers.get(CSRF_HEADER, "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(presented, session.csrf.encode()):
            raise Refused(
                403, "csrf_token_invalid", f"a console request must carry its {CSRF_HEADER}"
            )
    request[SESSION] = session
    request[WHO] = operator
    return operator


def still_allowed(request: web.Request, book: OperatorBook) -> bool:
    """Whether a long request (the event stream) may go on: its session still open and its
    operator still listed, or its Bearer token still an operator's. Checked at most every
    ``RECHECK_S``, so logging out, a session's end or an operator's removal closes the
    streams it opened."""
    now = time.monotonic()
    if now - request.get(CHECKED, 0.0) < RECHECK_S:
        return True
    request[CHECKED] = now
    authorization = request.headers.get("Authorization")
    if authorization is not None:
        return book.authenticate(authorization) is not None
    session = request.get(SESSION)
    if session is None:
        return False
    return request.app[SESSIONS].alive(session) and book.by_digest(session.digest) is not None


# --- handlers -------------------------------------------------------------------------------


def _file(name: str) -> web.Response:
    if name not in FILES:
        raise web.HTTPNotFound()
    return web.Response(
        body=(CONSOLE_DIR / name).read_bytes(),
        headers={"Content-Type": FILES[name], "Cache-Control": "no-cache"},
    )


async def console_redirect(request: web.Request) -> web.Response:
    raise web.HTTPPermanentRedirect("/console/")


async def console_page(request: web.Request) -> web.Response:
    return _file("index.html")


async def console_file(request: web.Request) -> web.Response:
    return _file(request.match_info["file"])


async def _login_token(request: web.Request) -> str:
    if request.content_type != "application/json":
        raise Refused(400, "admin_request_invalid", "log in with a JSON body")
    try:
        body = json.loads(await request.read())
    except (ValueError, UnicodeDecodeError):
        raise Refused(400, "admin_request_invalid", "the request body is not JSON") from None
    token = body.get("token") if isinstance(body, dict) and set(body) == {"token"} else None
    if not isinstance(token, str):
        raise Refused(400, "admin_request_invalid", 'expected {"token": "..."}')
    return token.strip()


async def console_login(request: web.Request) -> web.Response:
    why = _cross_site(request)
    if why is not None:
        raise Refused(403, "cross_site_refused", why)
    token = await _login_token(request)
    book: OperatorBook = request.app[BOOK]
    usable = 0 < len(token) <= MAX_TOKEN and token.isascii() and token.isprintable()
    operator = book.authenticate("Bearer " + token) if usable else None
    if operator is None:
        raise Refused(401, "operator_unauthenticated", "this is not an operator token")
    sessions = request.app[SESSIONS]
    session_id, session = sessions.open(token_digest(token))
    response = web.json_response(_session_body(operator, session, sessions))
    response.set_cookie(
        SESSION_COOKIE,
        session_id,
        path="/",
        max_age=int(sessions.ttl),
        httponly=True,
        samesite="Strict",
        secure=request.secure,
    )
    return response


def _session_body(
    operator: Operator, session: Session | None, sessions: Sessions
) -> dict[str, object]:
    return {
        "name": operator.name,
        "role": operator.role,
        "csrf": session.csrf if session is not None else None,
        "expires_in_s": sessions.remaining(session) if session is not None else None,
    }


async def console_session(request: web.Request) -> web.Response:
    session = request.get(SESSION)
    return web.json_response(_session_body(request[WHO], session, request.app[SESSIONS]))


async def console_logout(request: web.Request) -> web.Response:
    session = request.get(SESSION)
    if session is not None:
        request.app[SESSIONS].close(session)
    response = web.json_response({"ended": session is not None})
    response.del_cookie(SESSION_COOKIE, path="/")
    return response


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    response.headers.setdefault("Cache-Control", "no-store")


BOOK: web.AppKey[OperatorBook] = web.AppKey("console_operators", OperatorBook)


def install_console(app: web.Application, book: OperatorBook) -> None:
    """Sessions and the security headers of every answer, on the admin application."""
    app[SESSIONS] = Sessions()
    app[BOOK] = book
    app.on_response_prepare.append(_security_headers)
