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
    assert launch.main(["claude", "--config-only", "--write"]) == 0
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
    assert launch.main(["opencode", "--config-only", "--write"]) == 0
    data = json.loads(cfg.read_text())
    p = data["provider"]["ostinato"]
    assert p["npm"] == "@ai-sdk/openai-compatible"
    assert p["options"] == {"baseURL": "http://127.0.0.1:8385/v1", "apiKey": "s3cret"}
    assert p["models"]["qwen3-30b"]["limit"]["context"] == 131072  # no daemon: the n_ctx setting's default
    assert data["model"] == data["small_model"] == "ostinato/qwen3-30b"
    assert data["provider"]["other"] == {"npm": "x"} and data["theme"] == "t"


def test_codex_responses_provider_merges_toml(env, capsys):
    cfg = env / ".codex" / "config.toml"
    cfg.parent.mkdir()
    cfg.write_text('# my codex config\napproval_policy = "on-request"\n\n'
                   '[model_providers.other]\nname = "o"\nbase_url = "http://x/v1"\n')
    assert launch.main(["codex", "--config-only", "--write", "--url", "http://127.0.0.1:9000/v1"]) == 0
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
    assert launch.main(["openhands", "--docker"]) == 0
    out = capsys.readouterr().out
    assert "LLM_BASE_URL=http://host.docker.internal:8385/v1" in out
    assert "LLM_MODEL=openai/ostinato-demo-random-weights" in out
    assert 'host = "0.0.0.0"' in out and "cannot reach" in out
    monkeypatch.setenv("OSTINATO_HOST", "0.0.0.0")
    monkeypatch.setenv("OSTINATO_API_KEY", "k")
    assert launch.main(["openhands", "--docker", "--write"]) == 0
    out = capsys.readouterr().out
    assert "cannot reach" not in out
    envfile = launch.config_path("openhands", docker=True)
    assert "LLM_API_KEY=k\n" in envfile.read_text()


def test_broken_existing_config_is_not_overwritten(env, capsys):
    cfg = env / ".claude" / "settings.json"
    cfg.parent.mkdir()
    cfg.write_text("{broken")
    with pytest.raises(SystemExit) as e:
        launch.main(["claude", "--config-only", "--write"])
    assert "not valid JSON" in str(e.value)
    assert cfg.read_text() == "{broken"


def test_facts_come_from_the_running_daemon(env, capsys):
    from helpers import ControlThread
    from ostinatod.server.state import DaemonState
    from ostinatod.settings import load_settings

    def factory():
        st = DaemonState(settings=load_settings())
        st.http_url = "http://127.0.0.1:45678"
        st.model_info = {"path": "/models/served-model.gguf", "n_ctx": 32768}
        st.settings.api_key = "key-of-the-daemon"  # as `ostinatod run --api-key ...` would
        return st
    t = ControlThread(factory)
    try:
        assert launch.main(["opencode", "--config-only"]) == 0
        body = json.loads(capsys.readouterr().out.split("\n", 1)[1])
        assert launch.main(["claude", "--config-only"]) == 0
        claude, claude_err = capsys.readouterr()
        assert launch.main(["codex", "--config-only"]) == 0
        codex = tomllib.loads(capsys.readouterr().out.split("\n", 1)[1].split("# and export")[0])
        assert launch.main(["openhands", "--config-only"]) == 0
        openhands = capsys.readouterr().out
    finally:
        t.stop()
    p = body["provider"]["ostinato"]
    assert p["options"]["baseURL"] == "http://127.0.0.1:45678/v1"
    # the daemon's key (given to it as a flag, invisible to the settings here), not a placeholder
    assert p["options"]["apiKey"] == "key-of-the-daemon"
    assert "export ANTHROPIC_AUTH_TOKEN=key-of-the-daemon" in claude
    # the served context, told to every agent
    assert p["models"]["served-model"]["limit"]["context"] == 32768
    assert "export CLAUDE_CODE_AUTO_COMPACT_WINDOW=32768\n" in claude
    # below Claude Code's 100K compact minimum: said plainly
    assert "serves 32768 tokens per slot (the n_ctx setting)" in claude_err
    assert "compacts its conversation only past 100000 tokens" in claude_err
    assert codex["model_context_window"] == 32768 and codex["model_auto_compact_token_limit"] == 29491
    assert codex["model_providers"]["ostinato"]["env_key"] == "OSTINATO_API_KEY"
    assert "export LLM_MAX_INPUT_TOKENS=32768\n" in openhands
    assert "export LLM_BASE_URL=http://127.0.0.1:45678/v1\n" in openhands  # the SDK, not Docker


def test_agent_command_environment_and_arguments(env, tmp_path):
    facts = {"url": "http://127.0.0.1:8385", "model": "m", "n_ctx": 8192, "api_key": None}
    argv, e, notes = launch.agent_command("claude", facts, "k", ["-p", "hi"],
                                          {"PATH": "/bin", "ANTHROPIC_API_KEY": "real-anthropic-key"}, "/x/claude")
    assert argv == ["/x/claude", "-p", "hi"]
    assert e["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8385" and e["ANTHROPIC_AUTH_TOKEN"] == "k"
    assert "ANTHROPIC_API_KEY" not in e and e["PATH"] == "/bin" and not notes
    # the user's explicit ANTHROPIC_BASE_URL is not overridden
    argv, e, notes = launch.agent_command("claude", facts, "k", [], {"ANTHROPIC_BASE_URL": "http://proxy:1"},
                                          "/x/claude")
    assert e["ANTHROPIC_BASE_URL"] == "http://proxy:1" and "keeping your ANTHROPIC_BASE_URL" in notes[0]
    argv, e, _ = launch.agent_command("codex", facts, "k", ["exec", "hi"], {}, "/x/codex")
    assert argv[-2:] == ["exec", "hi"] and "model_context_window=8192" in argv
    (prov,) = [a for a in argv if a.startswith("model_providers.ostinato=")]
    assert tomllib.loads(prov.replace("model_providers.ostinato=", "p="))["p"]["wire_api"] == "responses"
    assert e["OSTINATO_API_KEY"] == "k"
    argv, e, _ = launch.agent_command("opencode", facts, "k", [], {}, "/x/opencode")
    cfg = json.loads(open(e["OPENCODE_CONFIG"]).read())
    assert cfg["provider"]["ostinato"]["models"]["m"]["limit"]["context"] == 8192


def test_launch_without_the_agent_installed_says_how(env, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert launch.main(["codex"]) == 127
    assert "npm install -g @openai/codex" in capsys.readouterr().err


FACTS = {"url": "http://127.0.0.1:8385", "model": "m", "n_ctx": 65536, "api_key": None}


def test_openhands_cli_gets_the_flag_and_saved_settings_with_the_context(env):
    """The OpenHands CLI (1.16) ignores LLM_* without --override-with-envs and
    reads the context only from agent_settings.json (an openhands.sdk Agent)."""
    user = env / ".openhands"
    user.mkdir()
    (user / "mcp.json").write_text('{"mcpServers": {}}')
    argv, e, _ = launch.agent_command("openhands", FACTS, "k", ["--headless", "-t", "hi"], {"HOME": str(env)},
                                      "/x/openhands")
    assert argv == ["/x/openhands", "--override-with-envs", "--headless", "-t", "hi"]
    assert e["LLM_MODEL"] == "openai/m" and e["LLM_BASE_URL"] == "http://127.0.0.1:8385/v1" and e["LLM_API_KEY"] == "k"
    d = launch.Path(e["OPENHANDS_PERSISTENCE_DIR"])
    s = json.loads((d / "agent_settings.json").read_text())
    assert s["kind"] == "Agent" and s["llm"]["max_input_tokens"] == 65536 and s["llm"]["model"] == "openai/m"
    assert s["condenser"]["llm"]["max_input_tokens"] == 65536
    assert (d / "mcp.json").resolve() == (user / "mcp.json").resolve()  # the user's MCP servers stay
    assert e["OPENHANDS_CONVERSATIONS_DIR"] == str(user / "conversations")
    assert stat.S_IMODE((d / "agent_settings.json").stat().st_mode) == 0o600


def test_qwen_aider_cline_are_told_the_served_context(env, capsys):
    """Each agent gets key, model, base URL and the served context in the form
    it reads; --config-only prints it, --write merges it into the agent's own files."""
    argv, e, _ = launch.agent_command("qwen", FACTS, "k", ["-p", "hi"], {}, "/x/qwen")
    assert argv == ["/x/qwen", "-p", "hi"]
    assert (e["OPENAI_BASE_URL"], e["OPENAI_API_KEY"], e["OPENAI_MODEL"]) == ("http://127.0.0.1:8385/v1", "k", "m")
    d = json.loads(open(e["QWEN_CODE_SYSTEM_DEFAULTS_PATH"]).read())
    assert d["model"]["generationConfig"]["contextWindowSize"] == 65536
    assert d["security"]["auth"]["selectedType"] == "openai"
    argv, e, _ = launch.agent_command("aider", FACTS, "k", [], {}, "/x/aider")
    assert e["AIDER_MODEL"] == "openai/m" and e["OPENAI_API_BASE"] == "http://127.0.0.1:8385/v1"
    meta = json.loads(open(e["AIDER_MODEL_METADATA_FILE"]).read())
    assert meta["openai/m"]["max_input_tokens"] == 65536
    argv, e, _ = launch.agent_command("cline", FACTS, "k", [], {}, "/x/cline")
    prov = json.loads(open(e["CLINE_PROVIDER_SETTINGS_PATH"]).read())
    assert prov["lastUsedProvider"] == "openai-compatible"
    assert prov["providers"]["openai-compatible"]["settings"] == {
        "provider": "openai-compatible", "apiKey": "k", "model": "m", "baseUrl": "http://127.0.0.1:8385/v1"}
    models = json.loads((launch.Path(e["CLINE_PROVIDER_SETTINGS_PATH"]).parent / "models.json").read_text())
    assert models["providers"]["openai-compatible"]["models"]["m"]["contextWindow"] == 65536
    # --write merges into the agents' own files, keeping what is there
    qwen = env / ".qwen" / "settings.json"
    qwen.parent.mkdir()
    qwen.write_text(json.dumps({"ui": {"theme": "x"}, "model": {"generationConfig": {"timeout": 5}}}))
    assert launch.main(["qwen", "--config-only", "--write"]) == 0
    q = json.loads(qwen.read_text())
    assert q["ui"] == {"theme": "x"} and q["model"]["generationConfig"] == {"timeout": 5, "contextWindowSize": 131072}
    assert q["env"]["OPENAI_BASE_URL"] == "http://127.0.0.1:8385/v1"
    out = capsys.readouterr().out
    assert "QWEN_CODE_SYSTEM_DEFAULTS_PATH" in out and '"contextWindowSize": 131072' in out
    assert launch.main(["aider", "--config-only", "--write"]) == 0
    assert json.loads((env / ".aider.model.metadata.json").read_text())[
        "openai/ostinato-demo-random-weights"]["max_input_tokens"] == 131072
    assert launch.main(["cline", "--config-only", "--write"]) == 0
    assert (env / ".cline" / "data" / "settings" / "models.json").exists()


def test_launch_without_an_agent_lists_every_entry(env, capsys):
    assert launch.main([]) == 0
    out = capsys.readouterr().out
    for agent in launch.AGENTS:
        assert f"  {agent} " in out
    assert "npm install -g @qwen-code/qwen-code" in out or "qwen: on PATH" in out
