"""The HTTP bind address: logged as bound, and no open bind without an API key."""

from __future__ import annotations

import re

from ostinatod.server.app import is_loopback, open_bind_refusal


def test_open_bind_rule():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("myhost")
    assert open_bind_refusal("127.0.0.1", None, False) is None
    assert "refusing to bind '0.0.0.0'" in open_bind_refusal("0.0.0.0", None, False)
    assert open_bind_refusal("0.0.0.0", "k", False) is None
    assert open_bind_refusal("0.0.0.0", None, True) is None


def test_open_bind_without_key_is_refused_and_real_address_logged(start_daemon, tiny_model, monkeypatch):
    flags = ("--model", str(tiny_model), "--n-ctx", "512", "--n-slots", "1", "--n-threads", "1", "--host", "0.0.0.0")
    d = start_daemon(*flags, wait=False, timeout=60)
    assert d.proc.wait(60) == 2
    assert "refusing to bind '0.0.0.0' without an api_key" in d.log()
    monkeypatch.setenv("OSTINATO_API_KEY", "k")   # a key never goes on the command line (ps shows argv)
    d = start_daemon(*flags)
    m = re.search(r"listening on 0\.0\.0\.0:(\d+) \(pid \d+\); local clients use http://127\.0\.0\.1:(\d+)", d.log())
    assert m and m.group(1) == m.group(2), d.log()[-2000:]
    d.stop()
