"""Give deploy/requirements.txt the versions of constraints.txt (what the test suite runs on).

    python deploy/sync_pins.py        # run by `make lock`; tests/test_deploy.py checks it

Only the versions change: the image keeps its own list of runtime packages.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, _, version = line.strip().partition("==")
            out[canonical(name)] = version
    return out


def main() -> int:
    tested = pins(ROOT / "constraints.txt")
    target = ROOT / "deploy" / "requirements.txt"
    lines = []
    for line in target.read_text().splitlines(keepends=True):
        if "==" in line and not line.startswith("#"):
            name = line.strip().partition("==")[0]
            if canonical(name) not in tested:
                print(f"sync_pins: {name} is not in constraints.txt", file=sys.stderr)
                return 1
            line = f"{name}=={tested[canonical(name)]}\n"
        lines.append(line)
    target.write_text("".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
