"""The settings model: precedence of sources, validation, and the generated docs."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from ostinatod.settings import EngineSettings, Settings, load_settings, settings_markdown

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
        if name != "engine":
            assert f"`OSTINATO_{name.upper()}`" in text
    for name in EngineSettings.model_fields:
        assert f"| `engine.{name}` | `OSTINATO_ENGINE__{name.upper()}` |" in text


def test_upload_cpu_share_is_a_share_or_adapted(tmp_path, monkeypatch):
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    assert Settings().engine.upload_cpu_share == 0.0 and Settings().engine.prefill_prefetch
    assert Settings(engine={"upload_cpu_share": -1}).engine.upload_cpu_share == -1
    monkeypatch.setenv("OSTINATO_ENGINE__UPLOAD_CPU_SHARE", "0.25")
    assert Settings().engine.upload_cpu_share == 0.25
    for bad in (-0.5, 1.5):
        with pytest.raises(ValidationError, match="upload_cpu_share|less than or equal"):
            Settings(engine={"upload_cpu_share": bad})


def test_engine_table_and_the_old_top_level_keys(tmp_path, monkeypatch, caplog):
    # the [engine] table of the file, its nested env variables; a key from before the table (file,
    # env, keyword) still works, moved into it with one warning naming the new place
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path))
    (tmp_path / "config").mkdir()
    f = tmp_path / "config" / "settings.toml"
    f.write_text('port = 9001\n[engine]\ndecode_borrow = false\ncpu_branch_spins = 100\n')
    monkeypatch.setenv("OSTINATO_ENGINE__DECODE_PREFETCH_EXPERTS", "4")
    s = load_settings(engine={"decode_graph": True})
    assert (s.port, s.engine.decode_borrow, s.engine.cpu_branch_spins) == (9001, False, 100)
    assert (s.engine.decode_prefetch_experts, s.engine.decode_graph) == (4, True)
    assert not [r for r in caplog.records if "moved to the [engine] table" in r.getMessage()]
    f.write_text('decode_borrow = false\nprefill_prefetch_depth = 1\n')
    monkeypatch.setenv("OSTINATO_CPU_BRANCH_CLAIMS", "false")
    with caplog.at_level("WARNING", logger="ostinatod.settings"):
        s = load_settings(upload_cpu_share=-1)
    assert (s.engine.decode_borrow, s.engine.prefill_prefetch_depth) == (False, 1)
    assert (s.engine.cpu_branch_claims, s.engine.upload_cpu_share) == (False, -1)
    warned = [r.getMessage() for r in caplog.records if "moved to the [engine] table" in r.getMessage()]
    assert len(warned) == 1 and all(k in warned[0] for k in ("decode_borrow", "cpu_branch_claims",
                                                              "upload_cpu_share", "OSTINATO_ENGINE__"))
    with pytest.raises(ValidationError):
        Settings(engine={"no_such_knob": 1})