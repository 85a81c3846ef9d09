"""The settings model: precedence of sources, validation, and the generated docs."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from ostinatod.settings import Settings, load_settings, settings_markdown

DOCS = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_file_env_and_override_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "settings.toml").write_text('port = 9001\nn_slots = 3\nlog_level = "DEBUG"\n')
    monkeypatch.setenv("OSTINATO_N_SLOTS", "4")
    s = load_settings(log_level="WARNING")
    assert (s.port, s.n_slots, s.log_level) == (9001, 4, "WARNING")
    assert s.host == "127.0.0.1"  # loopback unless asked otherwise


def test_unknown_and_invalid_values_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    with pytest.raises(ValidationError):
        Settings(port=70000)
    with pytest.raises(ValidationError):
        Settings(no_such_knob=1)


def test_docs_list_every_setting_and_are_current():
    text = DOCS.read_text()
    assert settings_markdown() in text, "docs/settings.md is stale: regenerate it (see its header)"
    for name in Settings.model_fields:
        assert f"`OSTINATO_{name.upper()}`" in text


def test_upload_cpu_share_is_a_share_or_adapted(tmp_path, monkeypatch):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    assert Settings().upload_cpu_share == 0.0 and Settings().prefill_prefetch
    assert Settings(upload_cpu_share=-1).upload_cpu_share == -1
    monkeypatch.setenv("OSTINATO_UPLOAD_CPU_SHARE", "0.25")
    assert Settings().upload_cpu_share == 0.25
    for bad in (-0.5, 1.5):
        with pytest.raises(ValidationError, match="upload_cpu_share|less than or equal"):
            Settings(upload_cpu_share=bad)
