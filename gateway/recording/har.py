"""HAR 1.2 export and import, so recordings open in browser tools and captures seed them.

``export_har(dir)`` turns a recording into a HAR 1.2 ``log``: one entry per record, URLs
built from the upstream URLs in the manifest (``http://<upstream>.capgate.invalid`` when
unknown), redaction markers as text, binary bodies base64 with ``encoding: "base64"``, and
capgate's own fields (run, seq, decision, roles, chunks, ...) under ``_capgate`` (HAR allows
custom fields that start with ``_``), so export then import keeps them. A denial becomes an
entry whose response is the status the agent got, with ``_capgate.kind == "denial"``.

``import_har(har, dir, upstream_map)`` writes a recording from a HAR file written by any
tool (browser developer tools, mitmproxy, Charles, capgate). ``upstream_map`` maps URL
prefixes (``"https://api.example.com"`` or ``"https://api.example.com/v1"``) to upstream
names; the longest prefix wins; entries of other origins are skipped and counted. Every
entry goes through ``RecordingWriter.append``, so imported captures are redacted exactly like
recorded ones: cookies, authorization headers and token-like values never reach the
recording. HTTP/2 pseudo-headers are dropped; ``Content-Encoding`` and ``Content-Length`` of
responses are dropped too, because HAR holds the decoded body.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlencode

from gateway import __version__
from gateway.http_headers import HOP_BY_HOP
from gateway.recording.format import RecordingError, parse_iso_time
from gateway.recording.model import Decision, Entry, ErrorInfo, Exchange, ResponseData
from gateway.recording.reader import load_recording
from gateway.recording.redact import HeaderValue
from gateway.recording.writer import RecordingWriter

RESPONSE_DROP = HOP_BY_HOP | {"content-encoding", "content-length"}


def _text(value: HeaderValue) -> str:
    if isinstance(value, dict):
        if "secret" in value:
            return f"[secret:{value['secret']}]"
        return f"[redacted:{value.get('redacted', 'value')}]"
    return value


def _iso(wall: float) -> str:
    return (
        datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def _content(data: bytes, mime: str) -> dict[str, Any]:
    try:
        return {"size": len(data), "mimeType": mime, "text": data.decode("utf-8")}
    except UnicodeDecodeError:
        return {
            "size": len(data),
            "mimeType": mime,
            "text": base64.b64encode(data).decode("ascii"),
            "encoding": "base64",
        }


def _header(headers: list[tuple[str, HeaderValue]], name: str) -> str | None:
    return next((_text(v) for k, v in headers if k.lower() == name), None)


def _entry_to_har(e: Entry, run_started: float, base: str) -> dict[str, Any]:
    url = base + e.target if e.upstream else "http://capgate.invalid" + e.target
    query = []
    if "?" in e.target:
        for item in e.target.split("?", 1)[1].split("&"):
            name, _, value = item.partition("=")
            query.append({"name": unquote(name), "value": unquote(value)})
    req_headers = [{"name": k, "value": _text(v)} for k, v in e.request_headers]
    request: dict[str, Any] = {
        "method": e.method,
        "url": url,
        "httpVersion": "HTTP/1.1",
        "cookies": [],
        "headers": req_headers,
        "queryString": query,
        "headersSize": -1,
        "bodySize": 0,
    }
    body = e.request_bytes()
    if body:
        mime = _header(e.request_headers, "content-type") or "application/octet-stream"
        post = _content(body, mime)
        request["postData"] = {"mimeType": mime, "text": post["text"]}
        if "encoding" in post:
            request["postData"]["_encoding"] = "base64"
        request["bodySize"] = len(body)
    capgate: dict[str, Any] = {
        "run": e.run,
        "seq": e.seq,
        "kind": e.kind,
        "agent": e.agent,
        "roles": list(e.roles),
        "caps": list(e.caps) if e.caps is not None else None,
        "request_id": e.request_id,
        "upstream": e.upstream,
        "target": e.target,
        "decision": e.decision.as_json(),
    }
    if e.response is not None:
        r = e.response
        data = r.body.read() if r.body is not None else b""
        mime = _header(r.headers, "content-type") or ""
        response: dict[str, Any] = {
            "status": r.status,
            "statusText": r.reason,
            "httpVersion": "HTTP/1.1",
            "cookies": [],
            "headers": [{"name": k, "value": _text(v)} for k, v in r.headers],
            "content": _content(data, mime),
            "redirectURL": _header(r.headers, "location") or "",
            "headersSize": -1,
            "bodySize": len(data),
        }
        if r.chunks:
            capgate["chunks"] = [{"t": t, "size": n} for t, n in r.chunks]
        if not r.complete:
            capgate["complete"] = False
    else:
        status = e.decision.status or (e.error.status if e.error else 0)
        detail = {
            "reason": e.decision.reason
            if e.kind == "denial"
            else (e.error.reason if e.error else "unknown"),
            "rule": e.decision.rule,
        }
        text = json.dumps(detail).encode()
        response = {
            "status": status,
            "statusText": "Refused by capgate" if e.kind == "denial" else "Upstream failed",
            "httpVersion": "HTTP/1.1",
            "cookies": [],
            "headers": [],
            "content": _content(text, "application/json"),
            "redirectURL": "",
            "headersSize": -1,
            "bodySize": -1,
        }
    if e.error is not None:
        capgate["error"] = {
            "reason": e.error.reason,
            "status": e.error.status,
            "detail": e.error.detail,
        }
    wait = round((e.duration or 0.0) * 1000, 3)
    return {
        "startedDateTime": _iso(run_started + e.t),
        "time": wait,
        "request": request,
        "response": response,
        "cache": {},
        "timings": {
            "blocked": -1,
            "dns": -1,
            "connect": -1,
            "ssl": -1,
            "send": 0,
            "wait": wait,
            "receive": 0,
        },
        "_capgate": capgate,
    }


def export_har(directory: str | Path) -> dict[str, Any]:
    """A recording as a HAR 1.2 document (a dict, ready for ``json.dump``)."""
    rec = load_recording(directory)
    upstreams = rec.manifest.get("upstreams") or {}
    entries: list[tuple[float, int, dict[str, Any]]] = []
    for run in rec.runs.values():
        started = parse_iso_time(str(run.manifest.get("started", "")))
        for e in run.entries:
            base = str(upstreams.get(e.upstream or "", f"http://{e.upstream}.capgate.invalid"))
            entries.append((started + e.t, e.seq, _entry_to_har(e, started, base.rstrip("/"))))
    entries.sort(key=lambda item: (item[0], item[1]))
    return {
        "log": {
            "version": "1.2",
            "creator": {"name": "capgate", "version": __version__},
            "pages": [],
            "entries": [item[2] for item in entries],
            "comment": f"exported from capgate recording {Path(directory).name}",
        }
    }


# --- import ----------------------------------------------------------------------------------


@dataclass(slots=True)
class ImportResult:
    imported: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # origin -> entries skipped
    runs: set[str] = field(default_factory=set)


class HarError(RecordingError):
    """Raised when a HAR document cannot be read; names the entry and field."""


def _parse_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def _map_url(url: str, prefixes: list[tuple[str, str]]) -> tuple[str, str, str] | None:
    """(upstream, target, prefix) for the longest prefix ``url`` starts with."""
    url = url.split("#", 1)[0]
    for prefix, name in prefixes:
        if url == prefix or url.startswith(prefix + "/") or url.startswith(prefix + "?"):
            target = url[len(prefix) :]
            if not target.startswith("/"):
                target = "/" + target
            return name, target, prefix
    return None


def _origin(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0].split('?', 1)[0]}"


_TEXTUAL = re.compile(
    r"^(text/|application/([\w.+-]*\+)?(json|xml|javascript|x-www-form-urlencoded|x-ndjson|graphql|sql|yaml)\b)"
)


def _textual(mime: Any) -> bool:
    return isinstance(mime, str) and bool(_TEXTUAL.match(mime.strip().lower()))


def _decode_content(content: Mapping[str, Any], where: str) -> bytes:
    """A HAR body's bytes: base64 when ``encoding`` (or capgate's ``_encoding``, on postData,
    where HAR 1.2 has no ``encoding``) says so; UTF-8 for a textual type; and for a binary
    type (``application/octet-stream``, ``image/png``, protobuf...) written as a string of
    code points 0-255, the way browsers and proxies put bytes in a HAR, those bytes (Latin-1),
    so the call matches on replay the body the agent sends."""
    text = content.get("text")
    if text is None:
        return b""
    if not isinstance(text, str):
        raise HarError(f"{where}: 'text' must be a string")
    if content.get("encoding") == "base64" or content.get("_encoding") == "base64":
        try:
            return base64.b64decode(text, validate=False)
        except ValueError:
            raise HarError(f"{where}: 'text' is not valid base64") from None
    mime = content.get("mimeType")
    if mime and not _textual(mime) and any(ord(c) > 0x7F for c in text):
        try:
            return text.encode("latin-1")
        except UnicodeEncodeError:
            pass  # beyond U+00FF: it was text after all
    return text.encode("utf-8")


def _pairs(items: Any, where: str) -> list[tuple[str, str]]:
    if items is None:
        return []
    if not isinstance(items, list):
        raise HarError(f"{where} must be a list of {{name, value}} objects")
    out: list[tuple[str, str]] = []
    for h in items:
        if not isinstance(h, dict) or not isinstance(h.get("name"), str):
            raise HarError(f"{where} must be a list of {{name, value}} objects")
        if h["name"].startswith(":"):  # HTTP/2 pseudo-headers
            continue
        out.append((h["name"], str(h.get("value", ""))))
    return out


def import_har(
    har: Mapping[str, Any],
    directory: str | Path,
    upstream_map: Mapping[str, str],
    *,
    run: str | None = None,
    agent: str | None = None,
    roles: Sequence[str] = (),
) -> ImportResult:
    """Write the entries of ``har`` whose URL maps to an upstream into a recording.

    Into an existing recording, entries are appended: each run's sequence numbers continue
    after its last one (a ``_capgate.seq`` already used is renumbered), so two imports never
    hold two calls with one number. ``agent`` and ``roles`` are recorded for entries that do
    not say theirs (a browser's HAR never does), so ``capgate policy test`` can re-decide
    them. Nothing is written when no entry maps (``imported`` is 0)."""
    log = har.get("log") if isinstance(har, Mapping) else None
    if not isinstance(log, Mapping) or not isinstance(log.get("entries"), list):
        raise HarError("not a HAR document: expected {'log': {'entries': [...]}}")
    prefixes = sorted(
        ((p.rstrip("/"), n) for p, n in upstream_map.items()),
        key=lambda item: len(item[0]),
        reverse=True,
    )
    result = ImportResult()
    mapped: list[tuple[float, str, Mapping[str, Any], Mapping[str, Any], tuple[str, str, str]]] = []
    for started, i, entry in _entries_by_time(log["entries"]):
        where = f"entries[{i}]"
        req = _request_of(entry, where)
        found = _map_url(req["url"], prefixes)
        if found is None:
            origin = _origin(req["url"])
            result.skipped[origin] = result.skipped.get(origin, 0) + 1
            continue
        mapped.append((started, where, entry, req, found))
    if not mapped:
        return result
    writer = RecordingWriter(Path(directory))
    first: dict[str, float] = {}
    for started, where, entry, req, (upstream, target, prefix) in mapped:
        capgate = dict(entry["_capgate"]) if isinstance(entry.get("_capgate"), Mapping) else {}
        if agent is not None and not capgate.get("agent"):
            capgate["agent"] = agent
        if roles and not capgate.get("roles"):
            capgate["roles"] = list(roles)
        run_name = str(capgate.get("run") or run or "default")
        base = first.setdefault(run_name, started)
        given = capgate.pop("seq", None)
        seq = writer.last_seq(run_name) + 1
        if isinstance(given, int) and not isinstance(given, bool) and given > seq:
            seq = given
        if isinstance(capgate.get("target"), str):
            target = capgate["target"]
        writer.append(
            _exchange(
                entry,
                req,
                capgate,
                where,
                run=run_name,
                seq=seq,
                t=max(started - base, 0.0),
                target=target,
                upstream=upstream,
            )
        )
        writer.remember_upstream(upstream, prefix)
        result.imported += 1
        result.runs.add(run_name)
    writer.write_manifest()
    return result


def _entries_by_time(entries: list[Any]) -> list[tuple[float, int, Mapping[str, Any]]]:
    """(start time, index, entry), oldest first (entries without a time first, in order)."""
    items: list[tuple[float, int, Mapping[str, Any]]] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            raise HarError(f"entries[{i}] must be an object")
        started = _parse_time(entry.get("startedDateTime"))
        items.append((started if started is not None else 0.0, i, entry))
    items.sort(key=lambda item: (item[0], item[1]))
    return items


def _request_of(entry: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """The entry's ``request``, which must have a string ``url`` and ``method``."""
    req = entry.get("request")
    if not isinstance(req, Mapping) or not isinstance(req.get("url"), str):
        raise HarError(f"{where}.request must be an object with a 'url'")
    if not isinstance(req.get("method"), str):
        raise HarError(f"{where}.request.method must be a string")
    return req


def _exchange(
    entry: Mapping[str, Any],
    req: Mapping[str, Any],
    capgate: Mapping[str, Any],
    where: str,
    *,
    run: str,
    seq: int,
    t: float,
    target: str,
    upstream: str,
) -> Exchange:
    """The record of one mapped HAR entry, numbered ``seq``."""
    resp = entry.get("response")
    body = _request_body(req.get("postData"), where)
    kind = "denial" if capgate.get("kind") == "denial" else "exchange"
    decision = _decision(capgate.get("decision"), resp)
    response: ResponseData | None = None
    error = _error_info(capgate.get("error"))
    if kind == "exchange" and isinstance(resp, Mapping):
        response, error = _response(resp, capgate, error, where)
    timings = entry.get("time")
    return Exchange(
        kind=kind,
        run=run,
        seq=seq,
        t=t,
        method=req["method"].upper(),
        target=target,
        upstream=upstream,
        agent=str(capgate["agent"]) if capgate.get("agent") else None,
        roles=tuple(str(r) for r in capgate.get("roles") or ()),
        caps=tuple(str(c) for c in capgate["caps"])
        if isinstance(capgate.get("caps"), list)
        else None,
        request_id=str(capgate.get("request_id") or ""),
        request_headers=_pairs(req.get("headers"), f"{where}.request.headers"),
        request_body=body,
        decision=decision,
        response=response,
        error=error,
        duration=float(timings) / 1000
        if isinstance(timings, int | float) and timings >= 0
        else None,
    )


def _request_body(post: Any, where: str) -> bytes | None:
    """The request body from ``postData``: its ``text``, else its ``params`` form-encoded."""
    if isinstance(post, Mapping):
        if post.get("text") is not None:
            return _decode_content(post, f"{where}.request.postData")
        if isinstance(post.get("params"), list):
            return urlencode(_pairs(post["params"], f"{where}.request.postData.params")).encode()
    return None


def _error_info(value: Any) -> ErrorInfo | None:
    """The gateway's error for the call, as exported under ``_capgate.error``."""
    if not isinstance(value, Mapping):
        return None
    return ErrorInfo(
        str(value.get("reason", "upstream_unavailable")),
        int(value.get("status", 502)),
        str(value.get("detail", "")),
    )


def _response(
    resp: Mapping[str, Any], capgate: Mapping[str, Any], error: ErrorInfo | None, where: str
) -> tuple[ResponseData | None, ErrorInfo | None]:
    """(response, error) of an exchange from the HAR ``response`` (status 0: no response)."""
    status = resp.get("status")
    if not isinstance(status, int) or isinstance(status, bool):
        raise HarError(f"{where}.response.status must be an integer")
    if status == 0 or (error is not None and resp.get("statusText") == "Upstream failed"):
        # The browser got no answer (status 0: blocked, aborted, network error).
        return None, error or ErrorInfo(
            "upstream_unavailable", 502, "imported from HAR: the request got no response"
        )
    if not 100 <= status <= 599:
        raise HarError(f"{where}.response.status {status} is not an HTTP status")
    content = resp.get("content") if isinstance(resp.get("content"), Mapping) else {}
    assert isinstance(content, Mapping)
    data = _decode_content(content, f"{where}.response.content")
    headers = [
        (k, v)
        for k, v in _pairs(resp.get("headers"), f"{where}.response.headers")
        if k.lower() not in RESPONSE_DROP
    ]
    chunks = _chunks(capgate.get("chunks"), len(data))
    response = ResponseData(
        status=status,
        reason=str(resp.get("statusText") or ""),
        headers=headers,
        body=data,
        chunks=chunks,
        complete=capgate.get("complete", True) is not False,
    )
    return response, error


def _decision(value: Any, resp: Any) -> Decision:
    if isinstance(value, Mapping) and isinstance(value.get("allowed"), bool):
        status = value.get("status")
        return Decision(
            allowed=value["allowed"],
            reason=str(value.get("reason") or ("allowed" if value["allowed"] else "no_rule")),
            rule=str(value["rule"]) if value.get("rule") else None,
            status=status if isinstance(status, int) else None,
        )
    status = resp.get("status") if isinstance(resp, Mapping) else None
    return Decision(True, "allowed", None, status if isinstance(status, int) and status else None)


def _chunks(value: Any, size: int) -> list[tuple[float, int]]:
    if not isinstance(value, list):
        return []
    try:
        chunks = [(float(c["t"]), int(c["size"])) for c in value]
    except (TypeError, KeyError, ValueError):
        return []
    return chunks if sum(n for _, n in chunks) == size else []
