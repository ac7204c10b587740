"""The transport of each mode: the one place a mode becomes a transport (``app.py`` asks once)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import NamedTuple

from gateway.errors import ConfigError
from gateway.recording.denial import DenialSink
from gateway.recording.format import RecordingError
from gateway.transport import Transport

MODES = ("live", "record", "replay", "replay-or-record", "shadow")


class ModeTransport(NamedTuple):
    """The transport of a mode, and where refused calls are told (record and replay)."""

    transport: Transport
    denials: DenialSink | None


def build_transport(
    mode: str,
    directory: Path | None,
    live: Transport,
    *,
    ci: bool,
    sample: float | None,
    report_path: Path | None = None,
    repeat_last: bool | Collection[str] = False,
    run_map: Mapping[str, str] | None = None,
) -> ModeTransport:
    """The transport for ``mode``; ``ConfigError`` (one readable line) when it cannot be built.

    =====================  ===============================================================
    mode                   transport
    =====================  ===============================================================
    ``live``               ``live`` itself
    ``record``             ``RecordTransport(live, directory, sample=sample)``
    ``replay``             ``ReplayTransport(directory)``; ``live`` is not used (it opens its
                           client lazily, so it never connected)
    ``replay-or-record``   replay, and record what misses; refused when ``ci`` is true
    ``shadow``             live, each answer compared with the recording
    =====================  ===============================================================

    ``ci`` is whether the environment says ``CI=true`` (read by the caller, in ``config.py``);
    ``report_path`` is where replay, replay-or-record and shadow write their end-of-run report
    (JSON) on ``close()``; ``repeat_last`` lets rules (all, or those ids) answer repeated calls
    with their last recording once the recorded ones are used up.
    """
    if mode not in MODES:
        raise ConfigError(f"mode has value {mode!r}; expected one of {list(MODES)}")
    if mode == "live":
        return ModeTransport(live, None)
    # Recording and replay load their machinery only when a mode uses it.
    from gateway.transports.record import RecordTransport
    from gateway.transports.replay import (
        ReplayOrRecordTransport,
        ReplayTransport,
        ShadowTransport,
    )

    if directory is None:
        raise ConfigError(f"mode {mode} needs a recordings directory (--recordings DIR)")
    if sample is not None and not 0.0 <= sample <= 1.0:
        raise ConfigError(f"sample has value {sample!r}; expected a fraction between 0 and 1")
    try:
        transport: RecordTransport | ReplayTransport | ReplayOrRecordTransport | ShadowTransport
        if mode == "record":
            transport = RecordTransport(live, directory, sample=sample)
        elif mode == "replay":
            transport = ReplayTransport(
                directory, repeat_last=repeat_last, run_map=run_map, report_path=report_path
            )
        elif mode == "replay-or-record":
            transport = ReplayOrRecordTransport(
                directory,
                live,
                ci=ci,
                sample=sample,
                repeat_last=repeat_last,
                run_map=run_map,
                report_path=report_path,
            )
        else:
            transport = ShadowTransport(directory, live, run_map=run_map, report_path=report_path)
    except RecordingError as exc:
        raise ConfigError(f"recordings: {exc}") from None
    return ModeTransport(transport, transport)


__all__ = ["MODES", "ModeTransport", "build_transport"]
