"""``ostinato launch``: what each agent is told, and merging into existing config files."""

from __future__ import annotations

import json
import stat
import tomllib

import pytest

from ostinatod import launch


@pytest.fixture()
def env(tmp_path, monkeypatch):
    import tempfile
    home = tmp_path / "user"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("CODEX_HOME", raising=False)
    monkeypatch.setenv("OSTINATO_HOME", tempfile.mkdtemp(prefix="ost-", dir="/tmp"))
    for k in ("OSTINATO_API_KEY", "OSTINATO_HOST", "OSTINATO_PORT", "OSTINATO_MODEL_ALIAS"):
        monkeypatch.delenv(k, raising=False)
    return home


def test_claude_base_url_has_no_v1_and_write_merges(env, capsys):
    settings = env / ".claude" / "settings.json"
    settings.parent.mkdir()
    settings.write_text(json.dumps({"theme": "dark", "env": {"KEEP": "1"}}))
    assert launch.main(["claude", "--write"]) == 0
    out = capsys.readouterr().out
    assert "export ANTHROPIC_BASE_URL=http://127.0.0.1:8385\n" in out
    data = json.loads(settings.read_text())
    assert data["theme"] == "dark" and data["env"]["KEEP"] == "1"
    e = data["env"]
    assert e["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8385"
    assert e["ANTHROPIC_AUTH_TOKEN"] == launch.PLACEHOLDER_KEY
    assert e["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == e["ANTHROPIC_MODEL"] == "ostinato-demo-random-weights"
    assert stat.S_IMODE(settings.stat().st_mode) == 0o600
    assert json.loads((settings.parent / "settings.json.bak").read_text())["theme"] == "dark"


def test_opencode_provider(env, capsys, monkeypatch):
    monkeypatch.setenv("OSTINATO_MODEL_ALIAS", "qwen3-30b")
    monkeypatch.setenv("OSTINATO_API_KEY", "s3cret")
    cfg = env / ".config" / "opencode" / "opencode.json"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(json.dumps({"provider": {"other": {"npm": "x"}}, "theme": "t"}))
    assert launch.main(["opencode", "--write"]) == 0
    data = json.loads(cfg.read_text())
    p = data["provider"]["ostinato"]
    assert p["npm"] == "@ai-sdk/openai-compatible"
    assert p["options"] == {"baseURL": "http://127.0.0.1:8385/v1", "apiKey": "s3cret"}
    assert p["models"]["qwen3-30b"]["limit"]["context"] == 65536
    assert data["model"] == data["small_model"] == "ostinato/qwen3-30b"
    assert data["provider"]["other"] == {"npm": "x"} and data["theme"] == "t"


def test_codex_responses_provider_merges_toml(env, capsys):
    cfg = env / ".codex" / "config.toml"
    cfg.parent.mkdir()
    cfg.write_text('# my codex config\napproval_policy = "on-request"\n\n'
                   '[model_providers.other]\nname = "o"\nbase_url = "http://x/v1"\n')
    assert launch.main(["codex", "--write", "--url", "http://127.0.0.1:9000/v1"]) == 0
    text = cfg.read_text()
    assert text.startswith("# my codex config")  # comments kept
    data = tomllib.loads(text)
    assert data["approval_policy"] == "on-request"
    assert data["model_provider"] == "ostinato"
    assert data["model_providers"]["ostinato"] == {"name": "Ostinato (local)",
                                                   "base_url": "http://127.0.0.1:9000/v1",
                                                   "wire_api": "responses"}
    assert data["model_providers"]["other"]["name"] == "o"
    printed = capsys.readouterr().out
    assert tomllib.loads(printed.split("\n", 1)[1])["model_providers"]["ostinato"]["wire_api"] == "responses"


def test_openhands_explains_opt_in_bind(env, capsys, monkeypatch):
    assert launch.main(["openhands"]) == 0
    out = capsys.readouterr().out
    assert "LLM_BASE_URL=http://host.docker.internal:8385/v1" in out
    assert "LLM_MODEL=openai/ostinato-demo-random-weights" in out
    assert 'host = "0.0.0.0"' in out and "cannot reach" in out
    monkeypatch.setenv("OSTINATO_HOST", "0.0.0.0")
    monkeypatch.setenv("OSTINATO_API_KEY", "k")
    assert launch.main(["openhands", "--write"]) == 0
    out = capsys.readouterr().out
    assert "cannot reach" not in out
    envfile = launch.config_path("openhands")
    assert "LLM_API_KEY=k\n" in envfile.read_text()


def test_broken_existing_config_is_not_overwritten(env, capsys):
    cfg = env / ".claude" / "settings.json"
    cfg.parent.mkdir()
    cfg.write_text("{broken")
    with pytest.raises(SystemExit) as e:
        launch.main(["claude", "--write"])
    assert "not valid JSON" in str(e.value)
    assert cfg.read_text() == "{broken"


def test_facts_come_from_the_running_daemon(env, capsys):
    from test_control import ControlThread
    from ostinatod.server.state import DaemonState
    from ostinatod.settings import load_settings

    def factory():
        st = DaemonState(settings=load_settings())
        st.http_url = "http://127.0.0.1:45678"
        st.model_info = {"path": "/models/served-model.gguf", "n_ctx": 32768}
        return st
    t = ControlThread(factory)
    try:
        assert launch.main(["opencode"]) == 0
    finally:
        t.stop()
    body = json.loads(capsys.readouterr().out.split("\n", 1)[1])
    p = body["provider"]["ostinato"]
    assert p["options"]["baseURL"] == "http://127.0.0.1:45678/v1"
    assert p["models"]["served-model"]["limit"]["context"] == 32768
