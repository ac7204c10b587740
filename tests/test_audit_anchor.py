"""Anchors: the latest checkpoint kept outside the sandbox (file, command, Redis)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gateway.audit_anchor import Anchor, AnchorSpec, publish, read_anchor
from tests.redis_server import RedisServer, redis_server_available


def test_specs() -> None:
    assert AnchorSpec.parse("file:/x/a") == AnchorSpec("file", "/x/a")
    assert AnchorSpec.parse("exec:logger -t capgate") == AnchorSpec("exec", "logger -t capgate")
    assert AnchorSpec.parse("redis", "redis://h:1/0") == AnchorSpec("redis", "redis://h:1/0")
    assert AnchorSpec.parse("redis://h:2/0") == AnchorSpec("redis", "redis://h:2/0")
    for bad in ("file:", "exec:", "ftp://x", "anchor.jsonl"):
        with pytest.raises(ValueError):
            AnchorSpec.parse(bad)
    with pytest.raises(ValueError, match="needs a redis:// state URL"):
        AnchorSpec.parse("redis", "memory")


def test_the_anchor_thread_publishes_the_latest_and_flushes_on_close(tmp_path: Path) -> None:
    target = tmp_path / "anchor.jsonl"
    anchor = Anchor(AnchorSpec("file", str(target)))
    for n in range(20):
        anchor.offer({"gateway": "gw", "hash": f"h{n}", "kind": "periodic"})
    anchor.offer({"gateway": "gw", "hash": "last", "kind": "shutdown"})
    anchor.close()
    entries = read_anchor(str(target))
    assert entries[-1]["hash"] == "last"  # earlier ones may have been coalesced
    assert anchor.health()["last"] == "last" and anchor.health()["error"] is None


def test_a_failing_anchor_is_shown_never_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    anchor = Anchor(AnchorSpec("file", str(blocker / "anchor.jsonl")))
    anchor.offer({"gateway": "gw", "hash": "h"})
    anchor.close()
    assert anchor.published == 0 and anchor.health()["error"]


def test_an_exec_anchor_gets_the_checkpoint_on_stdin(tmp_path: Path) -> None:
    out = tmp_path / "collected.jsonl"
    script = f"import sys; open({str(out)!r}, 'a').write(sys.stdin.read() + '\\n')"
    spec = AnchorSpec.parse(f"exec:{sys.executable} -c {json.dumps(script)}")
    publish(spec, {"gateway": "gw", "hash": "abc", "kind": "start"})
    assert read_anchor(f"file:{out}") == [{"gateway": "gw", "hash": "abc", "kind": "start"}]


@pytest.mark.skipif(not redis_server_available(), reason="redis-server not installed")
def test_a_redis_anchor_keeps_each_gateways_latest(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        spec = AnchorSpec.parse("redis", server.url)
        publish(spec, {"gateway": "gw-1", "hash": "a"})
        publish(spec, {"gateway": "gw-1", "hash": "b"})
        publish(spec, {"gateway": "gw-2", "hash": "c"})
        got = {e["gateway"]: e["hash"] for e in read_anchor(server.url)}
        assert got == {"gw-1": "b", "gw-2": "c"}
    finally:
        server.close()
