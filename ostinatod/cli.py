"""``ostinato``: the user's command-line tool (engine build, tools, and the control-API client).

Each subcommand lives in its own module with a ``main(argv) -> int``; this file only dispatches so
that subcommands stay independent. ``ostinato help`` lists them.
"""

from __future__ import annotations

import importlib
import os
import sys

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "build": ("ostinatod.build", "main", "build/install the native engine (llama.cpp + native/)"),
    "synth": ("ostinatod.synth.cli", "main", "write a synthetic MoE GGUF (qwen3moe, deepseek2, ...)"),
    "bench": ("ostinatod.bench.cli", "main", "benchmarks: 'bench replay' of recorded agent sessions, "
              "'bench engines' Ostinato vs stock"),
    "calibrate": ("ostinatod.engine.calibrate", "main", "calibrate the cost model and Np on this machine"),
    "plan": ("ostinatod.residency.planner", "main", "plan a residency set from routing traces"),
    "profile": ("ostinatod.profile", "main", "record the hardware profile"),
    "status": ("ostinatod.control.commands", "cmd_status", "daemon status (control API)"),
    "ps": ("ostinatod.control.commands", "cmd_ps", "active and recent requests"),
    "load": ("ostinatod.control.commands", "cmd_load", "load a model (path or name) into the running daemon"),
    "models": ("ostinatod.control.commands", "cmd_models", "GGUF models on disk (HF cache, LM Studio, Ollama)"),
    "unload": ("ostinatod.control.commands", "cmd_unload", "unload the model"),
    "residency": ("ostinatod.control.commands", "cmd_residency", "show/plan/switch residency sets"),
    "logs": ("ostinatod.control.commands", "cmd_logs", "print the daemon log"),
    "pause": ("ostinatod.control.commands", "cmd_pause", "unload the model until 'resume' (frees RAM/GPU memory)"),
    "resume": ("ostinatod.control.commands", "cmd_resume", "load the paused model again"),
    "tui": ("ostinatod.ui.tui", "main", "live terminal UI"),
    "tray": ("ostinatod.ui.tray", "main", "tray icon"),
    "launch": ("ostinatod.launch", "main", "start an agent on the daemon (claude, opencode, codex, openhands, qwen, aider, cline, ...)"),
}


def dispatch(prog: str, commands: dict[str, tuple[str, str, str]], argv: list[str] | None) -> int:
    """Run ``commands[argv[0]]`` (module, function, help) with the remaining arguments.

    Prints the command list for no argument or -h; returns 2 for an unknown or unavailable command.
    Shared by ``ostinato`` and its command groups (``ostinato bench``).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "\n".join([f"usage: {prog} COMMAND [ARGS...]", "", "commands:"] +
                       [f"  {name:<10} {h}" for name, (_, _, h) in commands.items()])
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"{prog}: unknown command {name!r}\n\n{usage}", file=sys.stderr)
        return 2
    mod_name, fn_name, _ = commands[name]
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            print(f"{prog}: command {name!r} is not available in this build", file=sys.stderr)
            return 2
        raise
    return int(getattr(mod, fn_name)(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    try:
        return dispatch("ostinato", COMMANDS, argv)
    except BrokenPipeError:  # `ostinato ps | head`: the reader left; quiet exit like other tools

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # no second error when Python flushes stdout at exit
        return 141  # 128 + SIGPIPE, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
