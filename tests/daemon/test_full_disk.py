"""A full disk: an atomic write that fails names the path and leaves nothing behind, ``ostinatod start``
says why it cannot start, and a residency plan is a clear error that keeps the earlier set (a small
tmpfs filled up, where the machine allows mounting one)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest

from hardening_helpers import chat, health, post


# ---- item 9: a full disk -------------------------------------------------------------------------

def test_write_atomic_failure_names_the_path_and_leaves_nothing(tmp_path):
    import errno

    from ostinatod.files import WriteFailed, write_json_atomic

    (tmp_path / "f").write_text("a file, not a directory")
    with pytest.raises(WriteFailed) as e:
        write_json_atomic(tmp_path / "f" / "set.json", {"a": 1})
    assert str(tmp_path / "f" / "set.json") in str(e.value) and not e.value.no_space
    assert errno.errorcode[e.value.errno] in str(e.value)  # EEXIST: the parent is a file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def _full_tmpfs_wrap(mount_at: Path, seed: Optional[Path] = None) -> tuple[str, ...]:
    """A command prefix that runs the command given after it (``exec``) in a user and mount
    namespace of its own (no root needed) where ``mount_at`` is a 16 KiB tmpfs holding a copy of
    ``seed`` (if any) and filled up: a real full disk. Skips the test where such namespaces are
    not allowed."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    mount_at.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run(["unshare", "-r", "-m", "sh", "-c", f'mount -t tmpfs -o size=16k tmpfs "{mount_at}"'],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    copy = f'cp "{seed}" "{mount_at}/{seed.name}"; ' if seed else ""
    script = (f'set -e; mount -t tmpfs -o size=16k tmpfs "{mount_at}"; {copy}'
              f'dd if=/dev/zero of="{mount_at}/filler" bs=1024 count=64 2>/dev/null || true; exec "$@"')
    return ("unshare", "-r", "-m", "sh", "-c", script, "sh")


def test_ostinatod_start_on_a_full_disk_says_why(tmp_path, tiny_model):
    import os
    import subprocess
    import sys

    home = tmp_path / "home"
    r = subprocess.run([*_full_tmpfs_wrap(home), sys.executable, "-m", "ostinatod.daemon_cli", "start",
                        "--port", "0", "--model", str(tiny_model), "--wait", "60"],
                       capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k != "OSTINATOD_DETACHED"}
                       | {"OSTINATO_HOME": str(home)})
    assert r.returncode == 1, r.stdout + r.stderr
    # the child's reason comes through start's pipe (its log file could not be written: "OS")
    assert "No space left on device (ENOSPC)" in r.stderr and f"cannot write {home}" in r.stderr, r.stderr


def test_residency_plan_on_a_full_disk_is_a_clear_error_and_keeps_the_earlier_set(tmp_path, tiny_model):
    import os
    import subprocess
    import sys

    from conftest import launch_daemon
    from ostinatod.control.client import ControlAPIError, call
    from ostinatod.paths import residency_file
    from ostinatod.residency.sets import make_residency, model_block, write_residency

    home = tmp_path / "home"
    set_path = residency_file(model_block(tiny_model)["fingerprint"], "coding", home / "data")
    seed = write_residency(make_residency(model_block(tiny_model), {0: [1, 2]}), tmp_path / "coding.json")
    d = launch_daemon(home, "--model", str(tiny_model), "--n-ctx", "512", "--n-threads", "1",
                      "--engine-mode", "inprocess", "--expert-budget-frac", "0.5",
                      wrap=_full_tmpfs_wrap(set_path.parent, seed))
    try:
        for _ in range(2):  # routing traces to plan from (their directory is on the ordinary disk)
            assert post(d.url, "/v1/chat/completions", chat(2))[0] == 200
        with pytest.raises(ControlAPIError) as e:
            call("POST", "/residency/plan", {}, socket=d.control_socket)
        assert e.value.status == 507 and e.value.code == "disk_full", e.value
        assert str(set_path) in e.value.message and "ENOSPC" in e.value.message
        r = subprocess.run([sys.executable, "-m", "ostinatod.cli", "residency", "plan"], capture_output=True,
                           text=True, timeout=60, env=dict(os.environ, OSTINATO_HOME=str(home)))
        assert r.returncode == 1 and "ENOSPC" in r.stderr and str(set_path) in r.stderr, r.stderr
        # the daemon's view of the full tmpfs (its mount namespace): the earlier set, no temp file
        inside = Path(f"/proc/{d.pid}/root{set_path.parent}")
        assert sorted(p.name for p in inside.iterdir()) == ["coding.json", "filler"]
        assert (inside / "coding.json").read_bytes() == seed.read_bytes()
        assert health(d.url)["status"] == "ok"
    finally:
        d.stop()
