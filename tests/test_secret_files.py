"""The secret-file rule with real files, owners and groups: owner-only files, and
group-readable ones as Kubernetes mounts a secret volume (``defaultMode: 0440`` + ``fsGroup``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.errors import ConfigError
from gateway.secret_files import check_secret_file

ROOT = Path(__file__).resolve().parent.parent
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to other users needs root")
FOREIGN = 4242  # neither a group nor a user of this process


def make(path: Path, mode: int, uid: int | None = None, gid: int | None = None) -> Path:
    path.write_text("s3cret\n")
    os.chown(path, os.geteuid() if uid is None else uid, os.getegid() if gid is None else gid)
    os.chmod(path, mode)
    return path


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_owner_only_files_pass(tmp_path: Path, mode: int) -> None:
    check_secret_file(make(tmp_path / "k", mode))


@pytest.mark.parametrize("mode", [0o440, 0o640])
def test_group_readable_in_own_group_passes(tmp_path: Path, mode: int) -> None:
    check_secret_file(make(tmp_path / "k", mode))


@pytest.mark.parametrize("mode", [0o444, 0o644, 0o460, 0o660, 0o450, 0o470, 0o441, 0o604])
def test_other_bits_or_group_write_or_exec_refused(tmp_path: Path, mode: int) -> None:
    with pytest.raises(ConfigError, match="readable or writable by group or others"):
        check_secret_file(make(tmp_path / "k", mode))


@needs_root
def test_group_readable_in_a_foreign_group_refused(tmp_path: Path) -> None:
    path = make(tmp_path / "k", 0o440, gid=FOREIGN)
    with pytest.raises(ConfigError, match="not one of capgate's groups"):
        check_secret_file(path)
    os.chmod(path, 0o400)  # owner-only: the group does not matter
    check_secret_file(path)


@needs_root
def test_group_readable_owned_by_another_user_refused(tmp_path: Path) -> None:
    path = make(tmp_path / "k", 0o440, uid=FOREIGN)
    with pytest.raises(ConfigError, match="neither root nor capgate's user"):
        check_secret_file(path)


def test_not_a_regular_file_refused(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="not a regular file"):
        check_secret_file(tmp_path / "d")


@pytest.fixture
def kube_volume() -> Iterator[Path]:
    """A secret volume laid out as the kubelet does: a timestamped directory, ``..data``
    linking to it, each key a link through ``..data``; files root-owned, group 10001 (the
    pod's fsGroup), mode 0440; readable by a process of uid 10001 in a world-traversable
    directory."""
    base = Path(tempfile.mkdtemp(prefix="capgate-kube-", dir="/tmp"))
    os.chmod(base, 0o755)
    stamp = base / "..2026_12_02_00_00_00.000000001"
    stamp.mkdir(mode=0o755)
    for name, gid in (("token", 10001), ("other-group", 10002)):
        make(stamp / name, 0o440, uid=0, gid=gid)
    (base / "..data").symlink_to(stamp.name)
    for name in ("token", "other-group"):
        (base / name).symlink_to(f"..data/{name}")
    try:
        yield base
    finally:
        shutil.rmtree(base)


def check_as(uid: int, gid: int, groups: str, path: Path) -> subprocess.CompletedProcess[str]:
    """``check_secret_file(path)`` in a process of that user and groups (as the kubelet starts
    a container with runAsUser, runAsGroup and fsGroup)."""
    code = (
        "import sys; from pathlib import Path; from gateway.secret_files import check_secret_file\n"
        "from gateway.errors import ConfigError\n"
        "try:\n"
        "    check_secret_file(Path(sys.argv[1])); print(Path(sys.argv[1]).read_text().strip())\n"
        "except ConfigError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    return subprocess.run(
        [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={gid}",
            f"--groups={groups}",
            "--",
            sys.executable,
            "-c",
            code,
            str(path),
        ],
        env={"PYTHONPATH": str(ROOT), "PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        timeout=60,
    )


@needs_root
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv")
def test_kubernetes_secret_volume_read_as_the_image_user(kube_volume: Path) -> None:
    # runAsUser 10001, runAsGroup 10001, fsGroup 10001: the group is the supplementary one.
    ok = check_as(10001, 10001, "10001", kube_volume / "token")
    assert ok.returncode == 0, ok.stderr + ok.stdout
    assert ok.stdout.strip() == "s3cret"
    # fsGroup given as a supplementary group only (runAsGroup differs): still capgate's group.
    ok = check_as(10001, 20000, "10001", kube_volume / "token")
    assert ok.returncode == 0, ok.stderr + ok.stdout
    # A file whose group the process is not in: refused before reading (and unreadable anyway).
    refused = check_as(10001, 10001, "10001", kube_volume / "other-group")
    assert refused.returncode == 3, refused.stderr + refused.stdout
    assert "not one of capgate's groups" in refused.stdout
