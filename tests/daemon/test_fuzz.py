"""Reliability suite, fast part (docs/reliability.md): hypothesis-generated bodies and headers on every HTTP
route and the control socket of the live daemon: no 5xx, no hang, daemon and worker alive, no
request record left open. The long runs are ``ostinato bench reliability``."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")

from ostinatod.control import client as ctl  # noqa: E402
from ostinatod.bench import fuzz  # noqa: E402


def _alive(d) -> None:
    assert d.proc.poll() is None, "daemon died"
    assert d.worker_pids(), "no engine worker"
    d.wait_healthy(60)


def test_fuzz_http_routes(live_daemon):
    port = int(live_daemon.url.rsplit(":", 1)[1])
    workers = live_daemon.worker_pids()
    t = fuzz.fuzz(f"127.0.0.1:{port}", fuzz.HTTP_ROUTES, 150, port=port, timeout=60, seed=11)
    assert t.n_5xx == 0 and t.n_hangs == 0, (t.by_status, t.server_errors[:3], t.hangs[:3])
    _alive(live_daemon)
    assert live_daemon.worker_pids() == workers  # no worker crashed on the way
    assert ctl.call("GET", "/requests?limit=1", socket=live_daemon.control_socket)["active"] == []


def test_fuzz_control_socket(live_daemon):
    t = fuzz.fuzz(str(live_daemon.control_socket), fuzz.CONTROL_ROUTES, 60, timeout=60, seed=12)
    assert t.n_5xx == 0 and t.n_hangs == 0, (t.by_status, t.server_errors[:3], t.hangs[:3])
    _alive(live_daemon)
