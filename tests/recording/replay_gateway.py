"""``capgate serve --mode replay`` as the lead will wire it, for testing ``replay_command``.

Until ``serve`` has the ``--mode``, ``--recordings`` and ``--replay-report`` flags, this
script takes them, starts the real ``gateway.app.serve`` with the other flags, and swaps the
transport for ``build_transport(mode, ...)``, as ``app.py`` will.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv: list[str]) -> int:
    from gateway import app
    from gateway.cli import build_parser
    from gateway.config import load_settings
    from gateway.recording import build_transport
    from gateway.recording.interim import install

    own = argparse.ArgumentParser()
    own.add_argument("--mode", required=True)
    own.add_argument("--recordings", type=Path, required=True)
    own.add_argument("--replay-report", type=Path)
    args, rest = own.parse_known_args(argv)
    install()
    real_build = app.build_gateway

    def build_gateway(settings, environ):  # type: ignore[no-untyped-def]
        gw = real_build(settings, environ)
        gw.transport = build_transport(
            args.mode,
            args.recordings,
            gw.transport,
            ci=True,
            sample=None,
            report_path=args.replay_report,
        )
        return gw

    app.build_gateway = build_gateway  # type: ignore[assignment]
    flags = vars(build_parser().parse_args(["serve", *rest]))
    flags = {k: v for k, v in flags.items() if k not in ("command", "config")}
    environ = dict(os.environ)
    try:
        settings = load_settings(flags, environ)
        app.configure_logging("warning")
        asyncio.run(app.serve(settings, environ))
    except Exception as exc:  # noqa: BLE001 - one line, like the real CLI
        print(f"capgate: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
