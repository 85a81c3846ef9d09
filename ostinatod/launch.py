"""``ostinato launch claude|opencode|openhands|codex [--write]``: point an agent at the daemon.

Prints the configuration each agent needs (facts in ../shared/CLIENTS.md); with ``--write`` merges
it into the agent's own config file (other keys are kept; the previous file is saved once as
``<file>.bak``):

* Claude Code: ``ANTHROPIC_BASE_URL`` **without** ``/v1`` (the client appends ``/v1/messages``),
  ``ANTHROPIC_AUTH_TOKEN``, the model for every slot (opus/sonnet/haiku), no non-essential
  traffic, a long API timeout -> the ``env`` block of ``~/.claude/settings.json``.
* OpenCode: an ``@ai-sdk/openai-compatible`` provider with ``baseURL .../v1``, context/output
  limits, ``model`` and ``small_model`` -> ``~/.config/opencode/opencode.json``.
* OpenHands (LiteLLM, in Docker): ``openai/<model>`` at ``http://host.docker.internal:PORT/v1`` ->
  an env file for ``docker run --env-file``. Needs the daemon reachable from the docker bridge:
  the ``host`` setting (off by default, 127.0.0.1) must be opened, with an ``api_key``.
* Codex: a ``model_providers.ostinato`` entry with ``wire_api = "responses"`` ->
  ``~/.codex/config.toml`` (merged with tomlkit, comments kept).

Model name, URL and key come from the running daemon when one answers, else from the settings.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

from .settings import Settings, load_settings

AGENTS = ("claude", "opencode", "openhands", "codex")
PROVIDER = "ostinato"
# Any token works when the daemon has no api_key; clients refuse to start without one.
PLACEHOLDER_KEY = "ostinato-local"


def _daemon_facts(settings: Settings) -> dict[str, Any]:
    """``{"url", "model", "n_ctx", "running"}`` from the running daemon, else from settings."""
    url = f"http://127.0.0.1:{settings.port}"
    model = settings.model_alias or (Path(settings.model).stem if settings.model else "ostinato-demo-random-weights")
    n_ctx = settings.n_ctx
    running = False
    try:
        from .control.client import call
        s = call("GET", "/status")
        running = True
        url = (s.get("http_url") or url).rstrip("/")
        m = s.get("model") or {}
        model = m.get("id") or model
        n_ctx = m.get("n_ctx") or n_ctx
    except Exception:  # no daemon: settings are the truth
        pass
    return {"url": url.replace("://0.0.0.0:", "://127.0.0.1:"), "model": model, "n_ctx": int(n_ctx),
            "running": running}


def _port(url: str) -> str:
    return url.rsplit(":", 1)[-1].split("/")[0]


# --- per agent: (text to print, {path: merge function}) ------------------------------------------

def claude_env(url: str, model: str, key: str) -> dict[str, str]:
    """Claude Code environment. Base URL without /v1 (anthropics/claude-code#20416)."""
    return {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_AUTH_TOKEN": key,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,  # background calls (titles) use this slot
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "API_TIMEOUT_MS": "3000000",  # a cold 64K prefill on CPU takes minutes
    }


def opencode_provider(url: str, model: str, key: str, n_ctx: int) -> dict[str, Any]:
    """OpenCode provider block (``provider.ostinato``)."""
    return {"npm": "@ai-sdk/openai-compatible", "name": "Ostinato (local)",
            "options": {"baseURL": f"{url}/v1", "apiKey": key},
            "models": {model: {"name": model, "tool_call": True,
                               "limit": {"context": n_ctx, "output": min(32768, n_ctx // 2)}}}}


def openhands_env(url: str, model: str, key: str) -> dict[str, str]:
    """OpenHands (LiteLLM) environment for its Docker container."""
    return {"LLM_MODEL": f"openai/{model}", "LLM_BASE_URL": f"http://host.docker.internal:{_port(url)}/v1",
            "LLM_API_KEY": key}


def codex_provider(url: str, key_env: Optional[str]) -> dict[str, Any]:
    """Codex ``[model_providers.ostinato]`` table (Responses API only)."""
    p = {"name": "Ostinato (local)", "base_url": f"{url}/v1", "wire_api": "responses"}
    if key_env:
        p["env_key"] = key_env
    return p


def config_path(agent: str) -> Path:
    """Where ``--write`` puts ``agent``'s configuration."""
    home = Path.home()
    if agent == "claude":
        return home / ".claude" / "settings.json"
    if agent == "opencode":
        return Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "opencode" / "opencode.json"
    if agent == "codex":
        return Path(os.environ.get("CODEX_HOME") or home / ".codex") / "config.toml"
    from .paths import get_paths
    return get_paths().config / "openhands.env"


def _backup(path: Path) -> None:
    bak = path.with_name(path.name + ".bak")
    if path.exists() and not bak.exists():
        shutil.copy2(path, bak)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text() or "{}")
    except json.JSONDecodeError as e:
        raise SystemExit(f"ostinato launch: {path} is not valid JSON ({e}); fix or move it, nothing written")
    if not isinstance(data, dict):
        raise SystemExit(f"ostinato launch: {path} does not hold a JSON object; nothing written")
    return data


def write_config(agent: str, facts: dict[str, Any], key: str, key_env: Optional[str]) -> Path:
    """Merge ``agent``'s configuration into its config file; returns the path written."""
    url, model = facts["url"], facts["model"]
    path = config_path(agent)
    path.parent.mkdir(parents=True, exist_ok=True)
    if agent == "claude":
        data = _read_json(path)
        data.setdefault("env", {}).update(claude_env(url, model, key))
        text = json.dumps(data, indent=2) + "\n"
    elif agent == "opencode":
        data = _read_json(path)
        data.setdefault("$schema", "https://opencode.ai/config.json")
        data.setdefault("provider", {})[PROVIDER] = opencode_provider(url, model, key, facts["n_ctx"])
        data["model"] = data["small_model"] = f"{PROVIDER}/{model}"
        text = json.dumps(data, indent=2) + "\n"
    elif agent == "codex":
        import tomlkit
        try:
            doc = tomlkit.parse(path.read_text()) if path.exists() else tomlkit.document()
        except tomlkit.exceptions.ParseError as e:
            raise SystemExit(f"ostinato launch: {path} is not valid TOML ({e}); nothing written")
        doc["model"] = model
        doc["model_provider"] = PROVIDER
        providers = doc.get("model_providers")
        if providers is None:
            providers = tomlkit.table(is_super_table=True)
            doc["model_providers"] = providers
        providers[PROVIDER] = codex_provider(url, key_env)
        text = tomlkit.dumps(doc)
    else:
        text = "".join(f"{k}={v}\n" for k, v in openhands_env(url, model, key).items())
    _backup(path)
    path.write_text(text)
    if agent in ("claude", "openhands"):
        path.chmod(0o600)  # carries the token
    return path


def render(agent: str, facts: dict[str, Any], key: str, key_env: Optional[str],
           settings: Settings) -> str:
    """The text ``ostinato launch AGENT`` prints: what to set, and where ``--write`` puts it."""
    url, model = facts["url"], facts["model"]
    dest = config_path(agent)
    if agent == "claude":
        env = claude_env(url, model, key)
        return ("# Claude Code: paste into your shell, then run `claude`\n" +
                "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()) +
                f"# --write puts these into the \"env\" block of {dest}\n")
    if agent == "opencode":
        body = {"$schema": "https://opencode.ai/config.json",
                "provider": {PROVIDER: opencode_provider(url, model, key, facts["n_ctx"])},
                "model": f"{PROVIDER}/{model}", "small_model": f"{PROVIDER}/{model}"}
        return f"// OpenCode: {dest} (--write merges this provider)\n{json.dumps(body, indent=2)}\n"
    if agent == "codex":
        import tomlkit
        doc = tomlkit.document()
        doc["model"], doc["model_provider"] = model, PROVIDER
        t = tomlkit.table(is_super_table=True)
        t[PROVIDER] = codex_provider(url, key_env)
        doc["model_providers"] = t
        extra = f"# and export {key_env}=<your api_key>\n" if key_env else ""
        return f"# Codex (Responses API): {dest} (--write merges this)\n{tomlkit.dumps(doc)}{extra}"
    env = openhands_env(url, model, key)
    lines = [f"# OpenHands runs in Docker: it reaches the daemon at host.docker.internal:{_port(url)}."]
    if settings.host in ("127.0.0.1", "localhost", "::1"):
        lines += ["# The daemon binds 127.0.0.1 (the default), which the docker bridge cannot reach.",
                  "# Opt in, with a key, in settings.toml (or OSTINATO_HOST / OSTINATO_API_KEY), then restart:",
                  '#   host = "0.0.0.0"        # or the docker bridge address, e.g. 172.17.0.1',
                  '#   api_key = "<a secret>"',
                  "#   ostinatod stop && ostinatod start"]
    elif not settings.api_key:
        lines.append(f"# WARNING: the daemon binds {settings.host} without an api_key; set one.")
    lines += [f"# Settings (LLM > Advanced): custom model, base URL, API key; or `docker run --env-file {dest}`",
              "# (on Linux also: --add-host host.docker.internal:host-gateway):"]
    lines += [f"{k}={v}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``ostinato launch AGENT [--write] [--url URL] [--model NAME]``."""
    ap = argparse.ArgumentParser(prog="ostinato launch", description="Configure an agent to use the "
                                 "Ostinato daemon (prints the configuration; --write merges it into "
                                 "the agent's config file).")
    ap.add_argument("agent", choices=AGENTS)
    ap.add_argument("--write", action="store_true", help="write/merge the agent's config file")
    ap.add_argument("--url", help="daemon base URL (default: the running daemon's, else settings)")
    ap.add_argument("--model", help="model name to configure (default: the served model)")
    a = ap.parse_args(argv)
    settings = load_settings()
    facts = _daemon_facts(settings)
    if a.url:
        facts["url"] = a.url.rstrip("/").removesuffix("/v1")
    if a.model:
        facts["model"] = a.model
    key = settings.api_key or PLACEHOLDER_KEY
    # Codex reads its key from an environment variable named in the provider entry
    key_env = "OSTINATO_API_KEY" if settings.api_key else None
    print(render(a.agent, facts, key, key_env, settings), end="")
    if not facts["running"]:
        print(f"# (no daemon answered; values from the settings. Start it with `ostinatod start`)",
              file=sys.stderr)
    if a.write:
        path = write_config(a.agent, facts, key, key_env)
        print(f"# wrote {path}", file=sys.stderr)
    return 0
