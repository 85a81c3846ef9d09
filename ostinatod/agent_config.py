"""What ``ostinato launch`` tells each agent (:mod:`ostinatod.launch`; facts in ../shared/CLIENTS.md):
the environment variables, settings blocks, provider entries and config file paths of Claude Code,
OpenCode, OpenHands, mini-swe-agent, Qwen Code, Aider, Cline and Codex, from the daemon's URL,
served model id, API key and served context (tokens). Pure functions: nothing here reads or writes
a file.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any, Optional

from .paths import get_paths


PROVIDER = "ostinato"


# Claude Code treats a smaller CLAUDE_CODE_AUTO_COMPACT_WINDOW as this (2.1.332: "the 100k minimum")
CLAUDE_MIN_COMPACT_WINDOW = 100_000


def port_of(url: str) -> str:
    return url.rsplit(":", 1)[-1].split("/")[0]


# --- per agent: (text to print, {path: merge function}) ------------------------------------------

def claude_env(url: str, model: str, key: str, n_ctx: int) -> dict[str, str]:
    """Claude Code environment. Base URL without /v1 (anthropics/claude-code#20416); the served
    context as the auto-compact window (Claude Code would assume 200K-1M tokens)."""
    return {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_AUTH_TOKEN": key,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,  # background calls (titles) use this slot
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "API_TIMEOUT_MS": "3000000",  # a cold 64K prefill on CPU takes minutes
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(n_ctx),
    }


def claude_context_note(n_ctx: int, reason: Optional[str] = None) -> Optional[str]:
    """Why Claude Code cannot compact in time on a context of ``n_ctx`` tokens per slot (None when it
    can): it compacts at no less than :data:`CLAUDE_MIN_COMPACT_WINDOW` tokens, so a smaller slot
    overflows first and the session ends on "prompt is too long". ``reason``: the daemon's reason
    for serving less than its setting."""
    if n_ctx >= CLAUDE_MIN_COMPACT_WINDOW:
        return None
    why = f" because {reason}" if reason else " (the n_ctx setting)"
    return (f"WARNING: the daemon serves {n_ctx} tokens per slot{why}; Claude Code compacts its "
            f"conversation only past {CLAUDE_MIN_COMPACT_WINDOW} tokens (a smaller "
            "CLAUDE_CODE_AUTO_COMPACT_WINDOW counts as that), so a long session will be refused "
            f"with 'prompt is too long' before it compacts. Serve n_ctx >= {CLAUDE_MIN_COMPACT_WINDOW} "
            "(settings n_ctx; fewer n_slots need less memory) and restart the daemon")


def opencode_provider(url: str, model: str, key: str, n_ctx: int) -> dict[str, Any]:
    """OpenCode provider block (``provider.ostinato``)."""
    return {"npm": "@ai-sdk/openai-compatible", "name": "Ostinato (local)",
            "options": {"baseURL": f"{url}/v1", "apiKey": key},
            "models": {model: {"name": model, "tool_call": True,
                               "limit": {"context": n_ctx, "output": min(32768, n_ctx // 2)}}}}


def openhands_env(url: str, model: str, key: str, n_ctx: int, docker: bool = False) -> dict[str, str]:
    """OpenHands (LiteLLM) environment: the SDK/CLI on this machine, or (``docker``) its container."""
    base = f"http://host.docker.internal:{port_of(url)}/v1" if docker else f"{url}/v1"
    return {"LLM_MODEL": f"openai/{model}", "LLM_BASE_URL": base, "LLM_API_KEY": key,
            "LLM_MAX_INPUT_TOKENS": str(n_ctx), "LLM_MAX_OUTPUT_TOKENS": str(output_limit(n_ctx))}


def mini_env(url: str, model: str, key: str) -> dict[str, str]:
    """mini-swe-agent (LiteLLM) environment: the model as ``openai/<model>`` on our base URL, its
    first-run set-up wizard and its cost tracking (no price for a local model) switched off."""
    return {"MSWEA_CONFIGURED": "true", "MSWEA_MODEL_NAME": f"openai/{model}",
            "MSWEA_COST_TRACKING": "ignore_errors", "OPENAI_API_BASE": f"{url}/v1",
            "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": key}


def output_limit(n_ctx: int) -> int:
    """The output tokens an agent is told it may ask for: half the context, at most 32768."""
    return min(32768, n_ctx // 2)


def openhands_settings(url: str, model: str, key: str, n_ctx: int) -> dict[str, Any]:
    """The OpenHands CLI's saved agent settings (``agent_settings.json`` in its persistence dir,
    an ``openhands.sdk.Agent``): the LLM on our base URL with the served context as
    ``max_input_tokens`` (the CLI reads no variable for it), and its default summarizing condenser
    on the same LLM. Tools are not stored: the CLI sets them at each start."""
    def llm(usage: str) -> dict[str, Any]:
        return {"model": f"openai/{model}", "base_url": f"{url}/v1", "api_key": key,
                "max_input_tokens": n_ctx, "max_output_tokens": output_limit(n_ctx), "usage_id": usage}
    return {"kind": "Agent", "llm": llm("agent"), "system_prompt_kwargs": {"cli_mode": True},
            "condenser": {"kind": "LLMSummarizingCondenser", "llm": llm("condenser"),
                          "max_size": 80, "keep_first": 4}}


def qwen_defaults(model: str, n_ctx: int) -> dict[str, Any]:
    """Qwen Code settings (system-defaults layer, ``QWEN_CODE_SYSTEM_DEFAULTS_PATH``): the OpenAI
    protocol, the model, and the served context as ``contextWindowSize`` (it assumes 200k for a
    model it does not know, and compacts too late)."""
    return {"security": {"auth": {"selectedType": "openai"}},
            "model": {"name": model, "generationConfig": {"contextWindowSize": n_ctx}}}


def qwen_env(url: str, model: str, key: str) -> dict[str, str]:
    """Qwen Code's OpenAI-compatible credentials."""
    return {"OPENAI_API_KEY": key, "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_MODEL": model}


def aider_metadata(model: str, n_ctx: int) -> dict[str, Any]:
    """Aider's model metadata (LiteLLM's format, ``--model-metadata-file`` /
    ``~/.aider.model.metadata.json``): the served context and no cost."""
    return {f"openai/{model}": {"max_input_tokens": n_ctx, "max_tokens": output_limit(n_ctx),
                                "max_output_tokens": output_limit(n_ctx), "input_cost_per_token": 0.0,
                                "output_cost_per_token": 0.0, "litellm_provider": "openai", "mode": "chat"}}


def aider_env(url: str, model: str, key: str) -> dict[str, str]:
    """Aider's environment (its ``AIDER_*`` variables are its options): the model as
    ``openai/<model>`` on our base URL; update checks and analytics off (nothing to reach)."""
    return {"OPENAI_API_BASE": f"{url}/v1", "OPENAI_API_KEY": key, "AIDER_MODEL": f"openai/{model}",
            "AIDER_CHECK_UPDATE": "false", "AIDER_SHOW_RELEASE_NOTES": "false", "AIDER_ANALYTICS": "false"}


def cline_settings(url: str, model: str, key: str, n_ctx: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Cline CLI's ``providers.json`` and the ``models.json`` beside it: the ``openai-compatible``
    provider on our base URL, and the model's context window (Cline assumes 128000 otherwise)."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")
    providers = {"version": 1, "lastUsedProvider": CLINE_PROVIDER, "modes": {},
                 "providers": {CLINE_PROVIDER: {"settings": {"provider": CLINE_PROVIDER, "apiKey": key,
                                                             "model": model, "baseUrl": f"{url}/v1"},
                                                "updatedAt": now, "tokenSource": "manual"}}}
    models = {"version": 1, "providers": {CLINE_PROVIDER: {
        "provider": {"name": "Ostinato (local)", "baseUrl": f"{url}/v1", "defaultModelId": model},
        "models": {model: {"id": model, "name": model, "contextWindow": n_ctx, "maxInputTokens": n_ctx,
                           "maxTokens": output_limit(n_ctx), "capabilities": ["streaming", "tools"]}}}}}
    return providers, models


CLINE_PROVIDER = "openai-compatible"


def codex_provider(url: str, key_env: Optional[str]) -> dict[str, Any]:
    """Codex ``[model_providers.ostinato]`` table (Responses API only)."""
    p = {"name": "Ostinato (local)", "base_url": f"{url}/v1", "wire_api": "responses"}
    if key_env:
        p["env_key"] = key_env
    return p


def codex_context(n_ctx: int) -> dict[str, int]:
    """Codex's context keys: the served window, compaction at 90% of it."""
    return {"model_context_window": n_ctx, "model_auto_compact_token_limit": n_ctx * 9 // 10}


def config_path(agent: str, docker: bool = False) -> Path:
    """Where ``--write`` puts ``agent``'s configuration."""
    home = Path.home()
    if agent == "claude":
        return home / ".claude" / "settings.json"
    if agent == "opencode":
        return Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "opencode" / "opencode.json"
    if agent == "codex":
        return Path(os.environ.get("CODEX_HOME") or home / ".codex") / "config.toml"
    if agent == "qwen":
        return home / ".qwen" / "settings.json"
    if agent == "aider":
        return home / ".aider.model.metadata.json"  # aider reads it from the home directory
    if agent == "cline":
        return Path(os.environ.get("CLINE_DIR") or home / ".cline") / "data" / "settings" / "providers.json"
    if agent == "openhands" and not docker:
        return Path(os.environ.get("OPENHANDS_PERSISTENCE_DIR") or home / ".openhands") / "agent_settings.json"
    if agent == "mini":
        return get_paths().config / "mini-swe-agent.env"
    return get_paths().config / ("openhands-docker.env" if docker else "openhands.env")
