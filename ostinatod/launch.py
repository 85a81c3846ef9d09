"""``ostinato launch claude|opencode|openhands|openhands-sdk|codex|mini|qwen|aider|cline [--config-only]
[--write] [-- ARGS]``: start an agent pointed at the running daemon (like ``ollama launch``); without
an agent, list the entries. Before it starts, the URL the
agent will call is checked: when nothing answers there, launch says so and what to do, and exits 1.

URL, model, context size and API key come from the running daemon (control API ``GET
/connection``), else from the settings. By default the agent is started (``exec``) with the
environment and arguments it needs, ARGS passed on; ``--config-only`` prints the configuration
instead; ``--write`` also merges it into the agent's own config file (other keys are kept; the
previous file is saved once as ``<file>.bak``). Facts in ../shared/CLIENTS.md:

* Claude Code: ``ANTHROPIC_BASE_URL`` **without** ``/v1`` (the client appends ``/v1/messages``),
  ``ANTHROPIC_AUTH_TOKEN``, the model for every slot (opus/sonnet/haiku), the served context as
  its auto-compact window, no non-essential traffic, a long API timeout -> the ``env`` block of
  ``~/.claude/settings.json``. A ``ANTHROPIC_BASE_URL`` the user has set is kept.
* OpenCode: an ``@ai-sdk/openai-compatible`` provider with ``baseURL .../v1``, context/output
  limits, ``model`` and ``small_model`` -> ``~/.config/opencode/opencode.json`` (started with
  ``OPENCODE_CONFIG`` pointing at a file of its own, merged by OpenCode over the user's).
* OpenHands CLI (LiteLLM): it ignores ``LLM_*`` without ``--override-with-envs`` and reads the
  context only from its saved settings, so it is started with that flag and
  ``OPENHANDS_PERSISTENCE_DIR`` naming a dir of ours holding ``agent_settings.json`` (``openai/<model>``
  on ``http://127.0.0.1:PORT/v1``, ``max_input_tokens`` = the served context); or with ``--docker``
  ``http://host.docker.internal:PORT/v1`` in an env file for ``docker run --env-file`` (needs the
  daemon reachable from the docker bridge: ``host`` opened, with an ``api_key``); max input tokens
  = the served context.
* OpenHands SDK: the same variables for the user's program given after ``--``
  (``LLM.load_from_env()`` reads them).
* mini-swe-agent (LiteLLM): ``MSWEA_MODEL_NAME=openai/<model>``, ``OPENAI_API_BASE``, its set-up
  wizard (``MSWEA_CONFIGURED``) and cost tracking (``MSWEA_COST_TRACKING``) off.
* Qwen Code: ``OPENAI_API_KEY`` / ``OPENAI_BASE_URL`` / ``OPENAI_MODEL`` and a system-defaults file
  (``QWEN_CODE_SYSTEM_DEFAULTS_PATH``: the openai auth type, the model, ``contextWindowSize``).
* Aider: ``openai/<model>`` on ``OPENAI_API_BASE``, the context in a model-metadata file
  (``AIDER_MODEL_METADATA_FILE``; ``--write``: ``~/.aider.model.metadata.json``).
* Cline CLI: an ``openai-compatible`` provider in a ``providers.json`` of ours
  (``CLINE_PROVIDER_SETTINGS_PATH``) with the model's context window in the ``models.json`` beside it.
* Codex: a ``model_providers.ostinato`` entry with ``wire_api = "responses"`` and
  ``model_context_window`` -> ``~/.codex/config.toml`` (merged with tomlkit, comments kept); started
  with the same as ``-c`` overrides.

What each agent is told (environment, settings blocks, config paths) is in :mod:`ostinatod.agent_config`;
this module reads the daemon's facts, writes and merges the files, and starts the agent.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

import tomlkit

from .agent_config import (PROVIDER, port_of, aider_env, aider_metadata, claude_context_note, claude_env,
                           cline_settings, codex_context, codex_provider, config_path, mini_env,
                           opencode_provider, openhands_env, openhands_settings, qwen_defaults, qwen_env)
from .control.client import call
from .paths import get_paths
from .settings import Settings, load_settings


AGENTS = ("claude", "opencode", "openhands", "openhands-sdk", "codex", "mini", "qwen", "aider", "cline")


# one line per entry, for `ostinato launch` without an agent
ABOUT = {"claude": "Claude Code (Anthropic Messages API)",
         "opencode": "OpenCode (OpenAI chat completions)",
         "openhands": "OpenHands CLI (`pip install openhands`), or its Docker app with --docker",
         "openhands-sdk": "your OpenHands SDK program, given after --",
         "codex": "Codex CLI (Responses API)",
         "mini": "mini-swe-agent",
         "qwen": "Qwen Code (OpenAI chat completions)",
         "aider": "Aider (OpenAI chat completions)",
         "cline": "Cline CLI (OpenAI-compatible provider)"}


# Any token works when the daemon has no api_key; clients refuse to start without one.
PLACEHOLDER_KEY = "ostinato-local"


def _daemon_facts(settings: Settings) -> dict[str, Any]:
    """``{"url", "model", "n_ctx", "n_ctx_reason", "api_key", "running"}`` from the running daemon,
    else from settings (``n_ctx_reason``: why the daemon serves less than its n_ctx setting)."""
    url = f"http://127.0.0.1:{settings.port}"
    model = settings.model_alias or (Path(settings.model).stem if settings.model else "ostinato-demo-random-weights")
    n_ctx, key, reason = settings.n_ctx, settings.api_key, None
    running = False
    try:
        c = call("GET", "/connection")
        running = True
        url = (c.get("http_url") or url).rstrip("/")
        model = c.get("model") or model
        n_ctx = c.get("n_ctx") or n_ctx
        reason = c.get("n_ctx_reason")
        key = c.get("api_key") or key  # the daemon's key, however it was given (flag, env, file)
    except Exception:  # no daemon: settings are the truth
        pass
    return {"url": url.replace("://0.0.0.0:", "://127.0.0.1:"), "model": model, "n_ctx": int(n_ctx),
            "n_ctx_reason": reason, "api_key": key, "running": running}


def _merge(base: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``ours`` merged in: nested objects merged key by key, other values replaced."""
    out = dict(base)
    for k, v in ours.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (parents made), readable by the user only: it carries the key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o600)


def agent_files(agent: str, facts: dict[str, Any], key: str) -> dict[Path, str]:
    """The files :func:`agent_command` writes for ``agent`` under the config dir's ``agents/``
    (qwen, aider, cline, openhands), by path; the agent is pointed at them, the user's own
    configuration is not touched."""
    url, model, n_ctx = facts["url"], facts["model"], facts["n_ctx"]
    d = get_paths().config / "agents"
    dump = lambda v: json.dumps(v, indent=2) + "\n"  # noqa: E731
    if agent == "qwen":
        return {d / "qwen-system-defaults.json": dump(qwen_defaults(model, n_ctx))}
    if agent == "aider":
        return {d / "aider-model-metadata.json": dump(aider_metadata(model, n_ctx))}
    if agent == "cline":
        providers, models = cline_settings(url, model, key, n_ctx)
        return {d / "cline" / "providers.json": dump(providers), d / "cline" / "models.json": dump(models)}
    if agent == "openhands":
        return {d / "openhands" / "agent_settings.json": dump(openhands_settings(url, model, key, n_ctx))}
    return {}


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


def opencode_config(facts: dict[str, Any], key: str, base: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """OpenCode's configuration: ``base`` (the user's file, kept) with our provider and models."""
    data = dict(base or {})
    data.setdefault("$schema", "https://opencode.ai/config.json")
    data["provider"] = dict(data.get("provider") or {})
    data["provider"][PROVIDER] = opencode_provider(facts["url"], facts["model"], key, facts["n_ctx"])
    data["model"] = data["small_model"] = f"{PROVIDER}/{facts['model']}"
    return data


def write_config(agent: str, facts: dict[str, Any], key: str, key_env: Optional[str],
                 docker: bool = False) -> Path:
    """Merge ``agent``'s configuration into its config file; returns the path written."""
    url, model = facts["url"], facts["model"]
    path = config_path(agent, docker)
    path.parent.mkdir(parents=True, exist_ok=True)
    if agent == "claude":
        data = _read_json(path)
        data.setdefault("env", {}).update(claude_env(url, model, key, facts["n_ctx"]))
        text = json.dumps(data, indent=2) + "\n"
    elif agent == "opencode":
        text = json.dumps(opencode_config(facts, key, _read_json(path)), indent=2) + "\n"
    elif agent == "codex":
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
        for k, v in codex_context(facts["n_ctx"]).items():
            doc[k] = v
        text = tomlkit.dumps(doc)
    elif agent == "qwen":
        ours = {"env": qwen_env(url, model, key), **qwen_defaults(model, facts["n_ctx"])}
        text = json.dumps(_merge(_read_json(path), ours), indent=2) + "\n"
    elif agent == "aider":
        text = json.dumps(_merge(_read_json(path), aider_metadata(model, facts["n_ctx"])), indent=2) + "\n"
    elif agent == "cline":
        providers, models = cline_settings(url, model, key, facts["n_ctx"])
        mpath = path.with_name("models.json")
        merged_models = _merge(_read_json(mpath), models)
        text = json.dumps(_merge(_read_json(path), providers), indent=2) + "\n"
        _backup(mpath)
        _write_private(mpath, json.dumps(merged_models, indent=2) + "\n")
    elif agent == "openhands" and not docker:
        text = json.dumps(openhands_settings(url, model, key, facts["n_ctx"]), indent=2) + "\n"
    else:
        env = mini_env(url, model, key) if agent == "mini" else openhands_env(url, model, key, facts["n_ctx"], docker)
        text = "".join(f"{k}={v}\n" for k, v in env.items())
    _backup(path)
    path.write_text(text)
    if agent in ("claude", "openhands", "openhands-sdk", "mini", "qwen", "cline"):
        path.chmod(0o600)  # carries the token
    return path


def render(agent: str, facts: dict[str, Any], key: str, key_env: Optional[str],
           settings: Settings, docker: bool = False) -> str:
    """The text ``ostinato launch AGENT --config-only`` prints: what to set, and where ``--write``
    puts it."""
    url, model = facts["url"], facts["model"]
    dest = config_path(agent, docker)
    if agent == "claude":
        env = claude_env(url, model, key, facts["n_ctx"])
        return ("# Claude Code: paste into your shell, then run `claude`\n" +
                "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()) +
                f"# --write puts these into the \"env\" block of {dest}\n")
    if agent == "opencode":
        body = opencode_config(facts, key)
        return f"// OpenCode: {dest} (--write merges this provider)\n{json.dumps(body, indent=2)}\n"
    if agent == "codex":
        doc = tomlkit.document()
        doc["model"], doc["model_provider"] = model, PROVIDER
        for k, v in codex_context(facts["n_ctx"]).items():
            doc[k] = v
        t = tomlkit.table(is_super_table=True)
        t[PROVIDER] = codex_provider(url, key_env)
        doc["model_providers"] = t
        extra = f"# and export {key_env}=<your api_key>\n" if key_env else ""
        return f"# Codex (Responses API): {dest} (--write merges this)\n{tomlkit.dumps(doc)}{extra}"
    if agent in ("qwen", "aider"):
        (f, text), = agent_files(agent, facts, key).items()
        if agent == "qwen":
            env = {**qwen_env(url, model, key), "QWEN_CODE_SYSTEM_DEFAULTS_PATH": str(f)}
            head = ("# Qwen Code: set these, then run `qwen`; the defaults file tells it the protocol, the model\n"
                    f"# and the served context (contextWindowSize). --write merges both into {dest} instead.\n")
        else:
            env = {**aider_env(url, model, key), "AIDER_MODEL_METADATA_FILE": str(f)}
            head = ("# Aider: set these, then run `aider`; the metadata file gives it the served context.\n"
                    f"# --write merges the metadata into {dest}, which aider reads by itself.\n")
        return head + "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()) + f"# {f}:\n{text}"
    if agent == "cline":
        files = agent_files(agent, facts, key)
        (pf, ptext), (mf, mtext) = files.items()
        return (f"# Cline CLI: export CLINE_PROVIDER_SETTINGS_PATH={shlex.quote(str(pf))}, then run `cline`\n"
                f"# (models.json beside it gives the served context). --write merges both into {dest.parent}.\n"
                f"# {pf}:\n{ptext}# {mf}:\n{mtext}")
    if agent == "mini":
        return ("# mini-swe-agent (LiteLLM): set these, then run `mini`\n" +
                "".join(f"export {k}={shlex.quote(v)}\n" for k, v in mini_env(url, model, key).items()))
    env = openhands_env(url, model, key, facts["n_ctx"], docker)
    if not docker:
        (f, text), = agent_files("openhands", facts, key).items()
        return ("# OpenHands CLI (`pip install openhands`): it reads its saved settings, not these variables\n"
                f"# unless started with --override-with-envs, and no variable gives it the context: run\n"
                f"#   OPENHANDS_PERSISTENCE_DIR={shlex.quote(str(f.parent))} openhands --override-with-envs\n"
                f"# with the variables below set ({f} holds the served context as max_input_tokens;\n"
                f"# --write puts it into {dest}). OpenHands SDK code: `LLM.load_from_env()` reads the\n"
                "# variables (or: ostinato launch openhands-sdk -- python agent.py)\n" +
                "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()) +
                f"# {f}:\n{text}"
                "# (OpenHands in Docker: `ostinato launch openhands --docker --config-only`)\n")
    lines = [f"# OpenHands runs in Docker: it reaches the daemon at host.docker.internal:{port_of(url)}."]
    if settings.host in ("127.0.0.1", "localhost", "::1"):
        lines += ["# The daemon binds 127.0.0.1 (the default), which the docker bridge cannot reach.",
                  "# Opt in, with a key, in settings.toml (or OSTINATO_HOST / OSTINATO_API_KEY), then restart:",
                  '#   host = "0.0.0.0"        # or the docker bridge address, e.g. 172.17.0.1',
                  '#   api_key = "<a secret>"',
                  "#   ostinatod stop && ostinatod start"]
    elif not facts.get("api_key"):
        lines.append(f"# WARNING: the daemon binds {settings.host} without an api_key; set one.")
    lines += [f"# Settings (LLM > Advanced): custom model, base URL, API key; or `docker run --env-file {dest}`",
              "# (on Linux also: --add-host host.docker.internal:host-gateway):"]
    lines += [f"{k}={v}" for k, v in env.items()]
    return "\n".join(lines) + "\n"


BINARIES = {"claude": "claude", "opencode": "opencode", "codex": "codex", "openhands": "openhands",
            "mini": "mini", "qwen": "qwen", "aider": "aider", "cline": "cline"}  # openhands-sdk: the command after --


INSTALL = {"claude": "npm install -g @anthropic-ai/claude-code", "opencode": "npm install -g opencode-ai",
           "codex": "npm install -g @openai/codex", "openhands": "pip install openhands (Python >= 3.12)",
           "mini": "pip install mini-swe-agent", "openhands-sdk": "pip install openhands-sdk",
           "qwen": "npm install -g @qwen-code/qwen-code", "aider": "pipx install aider-chat",
           "cline": "npm install -g cline"}


def agent_command(agent: str, facts: dict[str, Any], key: str, args: list[str],
                  environ: dict[str, str], exe: str) -> tuple[list[str], dict[str, str], list[str]]:
    """(argv, environment, notes) that start ``agent`` (executable ``exe``) on the daemon, with the
    user's ``args`` passed on. ``environ`` is the user's environment: an ``ANTHROPIC_BASE_URL``
    set there is kept (the user points Claude Code somewhere on purpose)."""
    url, model, n_ctx = facts["url"], facts["model"], facts["n_ctx"]
    env, notes = dict(environ), []
    argv = [exe]
    if agent == "claude":
        ours = claude_env(url, model, key, n_ctx)
        if environ.get("ANTHROPIC_BASE_URL"):
            ours.pop("ANTHROPIC_BASE_URL")
            notes.append(f"keeping your ANTHROPIC_BASE_URL={environ['ANTHROPIC_BASE_URL']} "
                         f"(the daemon is at {url})")
        else:
            env.pop("ANTHROPIC_API_KEY", None)  # it would be sent instead of the daemon's token
        env.update(ours)
    elif agent == "opencode":
        path = get_paths().config / "agents" / "opencode.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(opencode_config(facts, key), indent=2) + "\n")
        path.chmod(0o600)  # carries the key
        env["OPENCODE_CONFIG"] = str(path)  # merged over the user's own configuration
    elif agent == "codex":
        prov = tomlkit.inline_table()
        prov.update(codex_provider(url, "OSTINATO_API_KEY"))
        for kv in [f"model_provider={json.dumps(PROVIDER)}", f"model={json.dumps(model)}",
                   f"model_providers.{PROVIDER}={prov.as_string()}",
                   *(f"{k}={v}" for k, v in codex_context(n_ctx).items())]:
            argv += ["-c", kv]
        env["OSTINATO_API_KEY"] = key
    elif agent == "mini":
        env.update(mini_env(url, model, key))
    elif agent in ("qwen", "aider", "cline"):
        files = agent_files(agent, facts, key)
        for path, text in files.items():
            _write_private(path, text)
        first = next(iter(files))
        env.update(qwen_env(url, model, key) if agent == "qwen" else aider_env(url, model, key) if agent == "aider"
                   else {})
        env[{"qwen": "QWEN_CODE_SYSTEM_DEFAULTS_PATH", "aider": "AIDER_MODEL_METADATA_FILE",
             "cline": "CLINE_PROVIDER_SETTINGS_PATH"}[agent]] = str(first)
    else:
        env.update(openhands_env(url, model, key, n_ctx))
        if agent == "openhands":
            # the CLI ignores LLM_* without --override-with-envs and reads the context only from its
            # saved settings: ours, in a persistence dir of their own; conversations and MCP servers
            # stay the user's
            (path, text), = agent_files(agent, facts, key).items()
            _write_private(path, text)
            user = Path(environ.get("OPENHANDS_PERSISTENCE_DIR") or Path(environ.get("HOME") or Path.home()) / ".openhands")
            mcp = path.parent / "mcp.json"
            if (user / "mcp.json").exists() and not mcp.exists():
                mcp.symlink_to(user / "mcp.json")
            env["OPENHANDS_PERSISTENCE_DIR"] = str(path.parent)
            env.setdefault("OPENHANDS_CONVERSATIONS_DIR", str(user / "conversations"))
            env.setdefault("OPENHANDS_SUPPRESS_BANNER", "1")
            argv.append("--override-with-envs")
    return argv + list(args), env, notes


def agent_url(agent: str, facts: dict[str, Any], env: dict[str, str]) -> str:
    """The base URL the started agent will call: the daemon's, or for Claude Code an
    ``ANTHROPIC_BASE_URL`` of the user's that :func:`agent_command` kept."""
    return env.get("ANTHROPIC_BASE_URL", facts["url"]) if agent == "claude" else facts["url"]


def unreachable(url: str, timeout: float = 3.0) -> Optional[str]:
    """Why nothing answers HTTP at ``url`` (None when something does: any status counts, an
    HTTP error is an answer)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        return str(getattr(e, "reason", None) or e)


def list_agents() -> str:
    """The text of ``ostinato launch`` without an agent: every entry, whether its program is on
    PATH, and how to install it where it is not."""
    lines = ["usage: ostinato launch AGENT [--config-only] [--write] [-- ARGS]", "", "agents:"]
    for agent in AGENTS:
        exe = BINARIES.get(agent)
        where = ("" if exe is None else f"  [{exe}: " + ("on PATH]" if shutil.which(exe) else
                                                          f"not on PATH; {INSTALL[agent]}]"))
        lines.append(f"  {agent:<14} {ABOUT[agent]}{where}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``ostinato launch AGENT [--config-only] [--write] [--docker] [--url URL] [--model NAME] [-- ARGS]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passed: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, passed = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="ostinato launch", description="Start an agent on the Ostinato "
                                 "daemon (URL, model, context and key from the running daemon); "
                                 "arguments after -- go to the agent.")
    ap.add_argument("agent", nargs="?", choices=AGENTS, help="the agent to start; none: list them")
    ap.add_argument("--config-only", action="store_true", help="print the configuration (and write the files of "
                    "Ostinato's own it names, under the config dir's agents/), do not start the agent")
    ap.add_argument("--write", action="store_true", help="also write/merge the agent's config file")
    ap.add_argument("--docker", action="store_true", help="openhands: the configuration for its Docker "
                    "container (host.docker.internal); implies --config-only")
    ap.add_argument("--url", help="daemon base URL (default: the running daemon's, else settings)")
    ap.add_argument("--model", help="model name to configure (default: the served model)")
    a, extra = ap.parse_known_args(argv)
    passed = extra + passed
    if a.agent is None:
        print(list_agents())
        return 0
    settings = load_settings()
    facts = _daemon_facts(settings)
    if a.url:
        facts["url"] = a.url.rstrip("/").removesuffix("/v1")
    if a.model:
        facts["model"] = a.model
    key = facts["api_key"] or PLACEHOLDER_KEY
    # Codex reads its key from an environment variable named in the provider entry
    key_env = "OSTINATO_API_KEY" if facts["api_key"] else None
    if not facts["running"]:
        print("# (no daemon answered; values from the settings. Start it with `ostinatod start`)",
              file=sys.stderr)
    short = claude_context_note(facts["n_ctx"], facts["n_ctx_reason"]) if a.agent == "claude" else None
    if short:
        print(f"# {short}", file=sys.stderr)
    if a.write:
        path = write_config(a.agent, facts, key, key_env, a.docker)
        print(f"# wrote {path}", file=sys.stderr)
    if a.config_only or a.docker:
        if not a.docker:  # our own files the printed variables name (the user's are not touched)
            for path, text in agent_files(a.agent, facts, key).items():
                _write_private(path, text)
        print(render(a.agent, facts, key, key_env, settings, a.docker), end="")
        return 0
    if a.agent == "openhands-sdk":  # the user's own program: `-- python agent.py`
        if not passed:
            print("ostinato launch openhands-sdk: give the command to run after --, e.g. "
                  "`ostinato launch openhands-sdk -- python agent.py` (its LLM.load_from_env() "
                  "reads the LLM_* variables set here)", file=sys.stderr)
            return 2
        what, passed = passed[0], passed[1:]
    else:
        what = BINARIES[a.agent]
    exe = shutil.which(what)
    if exe is None:
        print(f"ostinato launch: `{what}` is not on PATH; install it ({INSTALL[a.agent]}) "
              f"or see `ostinato launch {a.agent} --config-only`", file=sys.stderr)
        return 127
    cmd, env, notes = agent_command(a.agent, facts, key, passed, dict(os.environ), exe)
    for n in notes:
        print(f"# {n}", file=sys.stderr)
    url = agent_url(a.agent, facts, env)
    why = unreachable(url)
    if why is not None:
        fix = (f"unset ANTHROPIC_BASE_URL (the daemon is at {facts['url']}) or point it at a server that runs"
               if url != facts["url"] else "start the daemon (`ostinatod start`) or give its address with --url")
        print(f"ostinato launch: nothing answers at {url} ({why}), so {a.agent} would wait there; "
              f"{fix}", file=sys.stderr)
        return 1
    print(f"# starting {a.agent} on {url} (model {facts['model']}, context {facts['n_ctx']} tokens)",
          file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(cmd[0], cmd, env)
    return 0  # not reached
