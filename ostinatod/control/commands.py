"""The ``ostinato status|ps|load|unload|residency|logs|pause|resume`` commands, on the control-API
client (:mod:`.client`)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..paths import get_paths
from .client import ControlAPIError, DaemonNotRunning, call
from .snapshots import pool_lines


# --- formatting ----------------------------------------------------------------------------------

def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else (fmt.format(v) if isinstance(v, float) else str(v))


def format_status(s: dict[str, Any]) -> str:
    """Multi-line human summary of ``GET /status``."""
    m = s.get("model") or {}
    up = int(s.get("uptime_s") or 0)
    lines = [
        f"ostinatod  pid {s.get('pid')}, up {up // 3600}h{up % 3600 // 60:02d}m{up % 60:02d}s, "
        f"engine {s.get('engine_state')}" + ("  [PAUSED]" if s.get("paused") else ""),
        f"model      {m.get('id')}" + (f"  ({m.get('arch')}, {m.get('n_layer')} layers, "
                                        f"{m.get('n_expert')} experts, k={m.get('n_expert_used')})"
                                        if m.get("arch") else ""),
    ]
    if s.get("random_weights"):
        lines.append("           demo model with RANDOM WEIGHTS: output is gibberish (set a model with --model)")
    lines += [f"http       {s.get('http_url')}",
              f"workload   {s.get('workload')}",
              f"requests   {s.get('active_requests')} active, {s.get('requests_total')} total"]
    res = s.get("residency") or {}
    if res:
        lines.append(f"residency  {res.get('workload') or 'no set'}"
                     + (f", {res.get('hot_experts')} hot experts" if res.get("hot_experts") is not None else "")
                     + f", {res.get('switches') or 0} swaps, auto-switch {'on' if res.get('auto_switch') else 'off'}")
        lines += [f"           {line}" for line in pool_lines(res.get("pools"), s.get("gpus"))]
    sw = s.get("last_residency_switch")
    if sw:
        lines.append(f"last swap  {sw.get('previous_workload') or 'none'} -> {sw.get('workload') or sw.get('path')} "
                     f"in {_f(sw.get('seconds'))} s ({sw.get('reason') or 'control'})")
    return "\n".join(lines)


def format_requests(d: dict[str, Any]) -> str:
    """Table of ``GET /requests``: active first, then recent (newest first)."""
    hdr = f"{'id':<26} {'status':<12} {'workload':<10} {'client':<14} {'prompt':>7} {'cached':>7} " \
          f"{'out':>5} {'ttft s':>8} {'tpot s':>8}  started"
    rows = [hdr]
    for r in list(d.get("active", [])) + list(d.get("recent", [])):
        t = _dt.datetime.fromtimestamp(r.get("started") or 0).strftime("%H:%M:%S")
        rows.append(f"{str(r.get('id'))[:26]:<26} {str(r.get('status'))[:12]:<12} "
                    f"{str(r.get('workload'))[:10]:<10} {str(r.get('client'))[:14]:<14} "
                    f"{_f(r.get('prompt_tokens')):>7} {_f(r.get('cached_tokens')):>7} "
                    f"{_f(r.get('completion_tokens')):>5} {_f(r.get('ttft_s')):>8} {_f(r.get('tpot_s')):>8}  {t}")
        rows += [f"{'':<26} warning: {w}" for w in r.get("warnings") or []]
    if len(rows) == 1:
        rows.append("(no requests yet)")
    return "\n".join(rows)


# --- commands ------------------------------------------------------------------------------------

def _run(fn, *args) -> int:
    try:
        out = fn(*args)
    except DaemonNotRunning as e:
        print(f"ostinato: {e}", file=sys.stderr)
        return 3
    except ControlAPIError as e:
        print(f"ostinato: {e.message} [{e.code}]", file=sys.stderr)
        return 1
    if out is not None:
        print(out)
    return 0


def _parser(prog: str, desc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=f"ostinato {prog}", description=desc)
    ap.add_argument("--json", action="store_true", help="print the raw JSON answer")
    return ap


def cmd_status(argv: list[str]) -> int:
    """``ostinato status [--json]``: daemon, model, workload, request counts."""
    a = _parser("status", "Show the running daemon's status.").parse_args(argv)
    return _run(lambda: (lambda s: json.dumps(s, indent=2) if a.json else format_status(s))(call("GET", "/status")))


def cmd_ps(argv: list[str]) -> int:
    """``ostinato ps [-n N] [--json]``: active and recent requests with TTFT/TPOT."""
    ap = _parser("ps", "Active and recent requests.")
    ap.add_argument("-n", type=int, default=20, help="recent requests to show")
    a = ap.parse_args(argv)
    return _run(lambda: (lambda d: json.dumps(d, indent=2) if a.json else format_requests(d))(
        call("GET", f"/requests?limit={a.n}")))


def cmd_load(argv: list[str]) -> int:
    """``ostinato load PATH.gguf|NAME``: serve another model (waits until loaded); NAME is one that
    ``ostinato models`` lists (a model in the Hugging Face cache, LM Studio or Ollama)."""
    ap = _parser("load", "Load a GGUF model into the running daemon: a path, or a name that "
                 "'ostinato models' lists.")
    ap.add_argument("path", help="PATH.gguf or a model name from 'ostinato models'")
    a = ap.parse_args(argv)
    path = Path(a.path).expanduser()
    if not path.is_file() and not a.path.startswith(("/", ".", "~")):  # a name, or a relative path
        # lazy here and in cmd_models: the disk scan pulls the engine and planner modules, which
        # the other commands (status, ps, ...) need not import
        from ..discover import find_models, resolve_name
        try:
            path = Path(resolve_name(a.path, find_models(gpus=[])).path)
        except LookupError as e:
            if not a.path.endswith(".gguf"):
                print(f"ostinato: {e}", file=sys.stderr)
                return 1  # else: a path after all; the daemon says what is wrong with it
    return _run(lambda: (lambda d: json.dumps(d, indent=2) if a.json else
                         f"loaded {d['model'].get('id')} from {path} (engine {d['state']})")(
        call("POST", "/models/load", {"path": str(path.resolve())})))


def cmd_models(argv: list[str]) -> int:
    """``ostinato models [--json] [--source S]``: GGUF models on disk (needs no daemon)."""
    from ..discover import SOURCES, find_models, format_table  # lazy: see cmd_load
    ap = _parser("models", "GGUF models already on disk (Hugging Face cache, LM Studio, Ollama, "
                 "Ostinato's models directory) with architecture, size, quantisation, engine support "
                 "and a suggested expert pool; 'ostinato load NAME' serves one.")
    ap.add_argument("--source", action="append", choices=list(SOURCES), help="only these sources")
    a = ap.parse_args(argv)
    found = find_models(a.source)
    print(json.dumps([m.to_json() for m in found], indent=2) if a.json else format_table(found))
    return 0


def cmd_unload(argv: list[str]) -> int:
    """``ostinato unload``: free the model's RAM and GPU memory (the daemon keeps running)."""
    a = _parser("unload", "Unload the model.").parse_args(argv)
    return _run(lambda: (lambda d: json.dumps(d) if a.json else "unloaded")(call("POST", "/models/unload")))


def cmd_residency(argv: list[str]) -> int:
    """``ostinato residency [show] | plan [WORKLOAD] | switch WORKLOAD | switch --path FILE``."""
    ap = _parser("residency", "Show, plan or switch the residency set (hot experts) per workload.")
    ap.add_argument("action", nargs="?", default="show", choices=["show", "plan", "switch"])
    ap.add_argument("workload", nargs="?")
    ap.add_argument("--path", type=Path, help="switch: a residency set file instead of a workload")
    a = ap.parse_args(argv)

    def go():
        if a.action == "show":
            d = call("GET", "/residency")
            if a.json:
                return json.dumps(d, indent=2)
            cur = d.get("current") or {}
            share = cur.get("hot_route_share")
            lines = [f"workload {d.get('workload')}   hot-route share "
                     f"{'-' if share is None else f'{share:.1%}'}   residency {cur.get('residency') or '-'}"]
            for s in d.get("sets", []):
                lines.append(f"  set   {s['workload']:<16} {s['path']}")
            for s in d.get("traces", []):
                lines.append(f"  trace {s['workload']:<16} {s['path']}")
            if d.get("note"):
                lines.append(f"  ({d['note']})")
            return "\n".join(lines)
        if a.action == "plan":
            d = call("POST", "/residency/plan", {"workload": a.workload} if a.workload else {})
            return json.dumps(d, indent=2) if a.json else f"planned {d.get('workload')}: {d.get('path')}"
        if not a.workload and not a.path:
            raise ControlAPIError("invalid_request", "switch needs a WORKLOAD or --path FILE", 400)
        body = {"workload": a.workload} if a.workload else {}
        if a.path:
            body["path"] = str(a.path.expanduser().resolve())
        d = call("POST", "/residency/switch", body)
        return json.dumps(d, indent=2) if a.json else \
            f"switched to {d.get('workload') or d.get('path')} in {_f(d.get('seconds'))} s"
    return _run(go)


def cmd_logs(argv: list[str]) -> int:
    """``ostinato logs [-n N] [-f]``: the daemon log (read from the state dir; needs no daemon)."""
    ap = argparse.ArgumentParser(prog="ostinato logs", description="Print the daemon log.")
    ap.add_argument("-n", type=int, default=50, help="last N lines")
    ap.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    a = ap.parse_args(argv)
    path = get_paths().log_file
    if not path.exists():
        print(f"ostinato: no log yet at {path}", file=sys.stderr)
        return 1
    with open(path, "r", errors="replace") as f:
        lines = f.readlines()
        sys.stdout.write("".join(lines[-a.n:] if a.n > 0 else []))
        sys.stdout.flush()
        try:
            while a.follow:
                line = f.readline()
                if line:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                else:
                    time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


def cmd_pause(argv: list[str]) -> int:
    """``ostinato pause``: unload the model to free RAM/GPU memory; ``ostinato resume`` loads it back."""
    a = _parser("pause", "Unload the model until 'ostinato resume' (frees RAM and GPU memory).").parse_args(argv)
    return _run(lambda: (lambda d: json.dumps(d) if a.json else "paused (model unloaded; 'ostinato resume' "
                         "loads it again)")(call("POST", "/pause")))


def cmd_resume(argv: list[str]) -> int:
    """``ostinato resume``: load the model unloaded by ``ostinato pause``."""
    a = _parser("resume", "Load the model again after 'ostinato pause'.").parse_args(argv)
    return _run(lambda: (lambda d: json.dumps(d) if a.json else f"resumed (engine {d.get('state')})")(
        call("POST", "/resume")))
