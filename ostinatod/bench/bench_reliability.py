"""``ostinato bench reliability``: the long part of the reliability suite (docs/reliability.md).

Starts a daemon of its own (subprocess engine worker, a fresh OSTINATO_HOME) on the tiny synthetic
model (or ``--model``), then, in order:

1. fuzz: ``--requests`` hypothesis-generated requests over every HTTP route (bodies, headers) and
   ``--control-requests`` over the control socket (``ostinatod/bench/fuzz.py``);
2. concurrent greedy clients: ``--clients`` threads sending the same prompts at temperature 0;
3. slow connections: ``--slow`` half-sent request headers held open while /health is timed;
4. schema stall (a huge tool schema must not stall the others): ``--stalls`` requests whose tool has 3,000 properties (count_tokens
   and chat) and one 60 MiB prompt, while a bystander sends small chats; the engine kills
   (worker restarts) and the bystander's answers are counted;
5. keep-alive lockout: ``--keepalive`` connections (above the cap of 512) that each sent one
   GET and stay open, then a new client's /health;
6. distinct tools: ``--tool-requests`` requests, each with a tool definition no other had; the
   worker's RSS after the first tenth and at the end;
7. bad GGUF loads: ``ostinato load`` of copies of the model that llama.cpp refuses (unknown
   architecture, missing tensor, no tokenizer, no expert count) and of a vocab-only one; the
   reason given, and whether the served model stayed;
8. crashes: ``--kills`` times kill -9 of the worker in the middle of a stream, then one SIGSTOP
   of the worker; each time the seconds until /health is 200 again (recovery);
9. grammar: a regex pattern of 64 ``(a|b|c)*`` groups on every route that takes a
   schema or grammar, and a tool with a 20,000-value enum, while a bystander streams;
10. huge prompt: a prompt of about 80% of the context while a bystander streams (its longest
    token gap, and alone);
11. slow bodies: ``--slow-bodies`` connections that send complete headers and then a byte every
    4 s, while a new client's chat is timed;
12. control paths: load and residency switch naming a FIFO, a directory, /dev/zero, a
    5,000-character path, a 300-character file name and a NUL byte;

and prints the figures: requests, 5xx, hangs, daemon and worker alive, RSS (daemon + worker)
before and after, recovery times, and the tracebacks in the daemon's log and stdio (malformed HTTP
must be one line each). Exit code 0 when there were no 5xx, no hangs, no traceback, both processes are
alive, RSS grew less than 10% (fuzzing, and the distinct tools), the engine was never killed by
the schema stall or the grammar attacks, the bystanders and the new clients were served, every
grammar attack was a 4xx, no control path answer was a 5xx, every bad GGUF left the model
served, and, with ``--deterministic``, no concurrent greedy output differed from the sequential
ones; 1 otherwise. ``--json FILE`` writes the figures. Every attack is bounded in count and time
and goes to 127.0.0.1 only.

The daemon under attack and the HTTP helpers are in :mod:`.bench_reliability_daemon`, the attacks
(phases 2 to 12) in :mod:`.bench_reliability_attacks`; this module runs them and reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from . import fuzz
from ..synth.writer import write_synthetic_moe
from .bench_reliability_attacks import (phase_bad_ggufs, phase_control_paths, phase_crashes, phase_grammar,
                                        phase_greedy, phase_huge_prompt, phase_keepalive, phase_schema_stall,
                                        phase_slow, phase_slow_bodies, phase_tool_rss)
from .bench_reliability_daemon import Daemon, post_json, rss_of, wait_healthy, worker_pids


def run(a: argparse.Namespace) -> dict[str, Any]:
    model = Path(a.model) if a.model else _tiny_model()
    d = Daemon(model, ["--n-ctx", str(a.n_ctx), "--n-slots", "2", "--max-tokens-default", "4",
                       "--worker-ping-timeout-s", "3"] + (["--n-threads", str(a.threads)] if a.threads else [])
               + (["--deterministic"] if a.deterministic else []))
    out: dict[str, Any] = {"model": str(model), "daemon_home": str(d.home), "deterministic": a.deterministic}
    try:
        for _ in range(3):
            post_json(d.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "warm up"}],
                                                   "max_tokens": 4})
        time.sleep(2)
        rss0 = rss_of(d.proc.pid)
        t0 = time.monotonic()
        http = fuzz.fuzz(f"127.0.0.1:{d.port}", fuzz.HTTP_ROUTES, a.requests, port=d.port, timeout=a.timeout)
        ctl = fuzz.fuzz(d.socket, fuzz.CONTROL_ROUTES, a.control_requests, timeout=a.timeout)
        out["fuzz"] = {"http_requests": http.requests, "http_by_status": http.by_status, "http_5xx": http.n_5xx,
                       "http_hangs": http.n_hangs, "control_requests": ctl.requests,
                       "control_by_status": ctl.by_status, "control_5xx": ctl.n_5xx, "control_hangs": ctl.n_hangs,
                       "seconds": round(time.monotonic() - t0, 1), "max_answer_s": round(max(http.max_seconds,
                                                                                              ctl.max_seconds), 2),
                       "examples_5xx": (http.server_errors + ctl.server_errors)[:5],
                       "examples_hangs": (http.hangs + ctl.hangs)[:5],
                       "examples_dropped": (http.dropped + ctl.dropped)[:5]}
        out["greedy"] = phase_greedy(d, a.clients, a.prompts, a.greedy_tokens)
        out["slow_connections"] = phase_slow(d, a.slow)
        rss1 = rss_of(d.proc.pid)  # before the crashes and loads: a restarted worker starts from scratch
        out["schema_stall"] = phase_schema_stall(d, a.stalls)
        out["keepalive"] = phase_keepalive(d, a.keepalive)
        out["grammar"] = phase_grammar(d)
        out["huge_prompt"] = phase_huge_prompt(d, a.n_ctx)
        out["slow_bodies"] = phase_slow_bodies(d, a.slow_bodies)
        out["control_paths"] = phase_control_paths(d)
        out["tools"] = phase_tool_rss(d, a.tool_requests)
        out["bad_gguf"] = phase_bad_ggufs(d, model)
        out["crashes"] = phase_crashes(d, a.kills)
        out["rss"] = {"before_bytes": rss0, "after_bytes": rss1,
                      "growth_pct": round(100.0 * (rss1 - rss0) / rss0, 1) if rss0 else None}
        out["alive"] = {"daemon": d.proc.poll() is None, "worker": bool(worker_pids(d.proc.pid)),
                        "healthy": wait_healthy(d.url, 120) != float("inf")}
    finally:
        d.stop()
        out["log"] = _log_noise(d.home / "state")
    f, r = out.get("fuzz", {}), out.get("rss", {})
    st, ka, tl, g = (out.get(k, {}) for k in ("schema_stall", "keepalive", "tools", "greedy"))
    gr, hp, sb, cp = (out.get(k, {}) for k in ("grammar", "huge_prompt", "slow_bodies", "control_paths"))
    grb, hpb = gr.get("bystander", {}), hp.get("bystander_during", {})
    out["ok"] = bool(f and f["http_5xx"] == 0 and f["control_5xx"] == 0 and f["http_hangs"] == 0
                     and f["control_hangs"] == 0 and all(out["alive"].values())
                     and out["log"]["traceback_lines"] == 0
                     and (r.get("growth_pct") or 0) < 10
                     and st.get("engine_kills") == 0 and st.get("bystander_ok") == st.get("bystander_requests")
                     and ka.get("health_status_meanwhile") == 200
                     and (tl.get("growth_pct") or 0) < 10 and tl.get("same_worker")
                     and all(v["reason_named"] and v["model_stayed"] for v in out.get("bad_gguf", {}).values())
                     and (not a.deterministic or g.get("concurrent_differing") == 0)
                     and gr.get("engine_kills") == 0 and grb.get("ok") == grb.get("requests")
                     and all(400 <= v["status"] < 500 for v in gr.get("attacks", {}).values())
                     and hp.get("status") in (200, 400) and hpb.get("ok") == hpb.get("requests")
                     and sb.get("new_client_status") == 200 and cp.get("n_5xx") == 0)
    return out


# what a traceback in the daemon's output starts with (Python's, and aiohttp's two error lines)
_NOISE = ("Traceback (most recent call last)", "Error handling request", "Unhandled exception")


def _log_noise(state: Path) -> dict[str, Any]:
    """Traceback lines in the daemon's log and stdio under ``state`` (a Python traceback's first
    line and aiohttp's error line before it each count): ``{"traceback_lines": n, "lines": the
    first three}``."""
    hits: list[str] = []
    for name in ("ostinatod.log", "stdio.log"):
        try:
            text = (state / name).read_text(errors="replace")
        except OSError:
            continue
        hits += [line for line in text.splitlines() if any(n in line for n in _NOISE)]
    return {"traceback_lines": len(hits), "lines": hits[:3]}


def _tiny_model() -> Path:
    cache = Path(os.environ.get("OSTINATO_TEST_CACHE", Path.home() / ".cache" / "ostinato-test"))
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / "tiny-qwen3moe.gguf"
    if not path.exists():
        write_synthetic_moe(path, arch="qwen3moe", shape="tiny")
    return path


def report(out: dict[str, Any]) -> str:
    f, g, s, c, r, al = (out.get(k, {}) for k in ("fuzz", "greedy", "slow_connections", "crashes", "rss", "alive"))
    st, ka, tl = (out.get(k, {}) for k in ("schema_stall", "keepalive", "tools"))
    gr, hp, sb, cp = (out.get(k, {}) for k in ("grammar", "huge_prompt", "slow_bodies", "control_paths"))
    grb, hpa, hpd = gr.get("bystander", {}), hp.get("bystander_alone", {}), hp.get("bystander_during", {})
    lines = [
        f"model            {out['model']}{'  (deterministic = true)' if out.get('deterministic') else ''}",
        f"fuzzed requests  HTTP {f.get('http_requests')} ({f.get('http_5xx')} 5xx, {f.get('http_hangs')} hangs), "
        f"control {f.get('control_requests')} ({f.get('control_5xx')} 5xx, {f.get('control_hangs')} hangs) "
        f"in {f.get('seconds')} s; slowest answer {f.get('max_answer_s')} s",
        f"  HTTP statuses  {f.get('http_by_status')}",
        f"  control        {f.get('control_by_status')}",
        f"greedy clients   {g.get('requests')} requests, {g.get('failed')} failed; sequential runs equal "
        f"{g.get('sequential_runs_equal')}/{g.get('prompts')}; concurrent equal to a sequential run "
        f"{g.get('concurrent_equal_to_sequential')}/{g.get('concurrent_outputs')}, differing from a "
        f"sequential run {g.get('concurrent_differing')}",
        f"slow connections {s.get('opened')} half-sent headers open; /health meanwhile {s.get('health_status_meanwhile')} "
        f"in {s.get('health_seconds')} s",
        f"schema stall     {st.get('attacks')} 3,000-property requests {st.get('attack_statuses')} in "
        f"{st.get('attack_seconds')} s, 60 MiB prompt {st.get('prompt_60mib_status')} in "
        f"{st.get('prompt_60mib_seconds')} s; engine kills {st.get('engine_kills')}; bystander "
        f"{st.get('bystander_ok')}/{st.get('bystander_requests')} served, slowest {st.get('bystander_max_s')} s",
        f"keep-alive       {ka.get('held')} idle kept-alive connections held; new client /health "
        f"{ka.get('health_status_meanwhile')} in {ka.get('health_seconds')} s",
        *[f"grammar          {k}: {v['status']} in {v['seconds']} s" for k, v in gr.get("attacks", {}).items()],
        f"  meanwhile      engine kills {gr.get('engine_kills')}; streaming bystander {grb.get('ok')}/"
        f"{grb.get('requests')} served, longest token gap {grb.get('max_token_gap_s')} s",
        f"huge prompt      {hp.get('prompt_tokens')} tokens: {hp.get('status')} in {hp.get('seconds')} s; "
        f"bystander's longest token gap {hpd.get('max_token_gap_s')} s ({hpd.get('ok')}/{hpd.get('requests')} "
        f"served), alone {hpa.get('max_token_gap_s')} s",
        f"slow bodies      {sb.get('opened')} connections sending a byte every 4 s; new client "
        f"{sb.get('new_client_status')} in {sb.get('new_client_seconds')} s; flood ended {sb.get('flood_ended')}, "
        f"{sb.get('flood_still_open')} still open",
        f"control paths    {cp.get('n_5xx')} 5xx: " + ", ".join(f"{k}: {v}" for k, v in
                                                           (cp.get("answers") or {}).items()),
        f"distinct tools   {tl.get('requests')} requests {tl.get('statuses')} in {tl.get('seconds')} s; worker RSS "
        f"{tl.get('worker_rss_after_first_tenth_bytes', 0) / 2**20:.0f} MiB after the first tenth, "
        f"{tl.get('worker_rss_end_bytes', 0) / 2**20:.0f} MiB at the end ({tl.get('growth_pct')}%)",
        *[f"bad GGUF         {k}: model stayed {v['model_stayed']}, reason named {v['reason_named']} "
          f"({v['said'][:90]})" for k, v in out.get("bad_gguf", {}).items()],
        f"crashes          {c.get('kills')} kill -9 mid-stream: recovery {c.get('recovery_s')} s; SIGSTOP: "
        f"{c.get('sigstop_recovery_s')} s",
        f"RSS              {r.get('before_bytes', 0) / 2**20:.0f} MiB before, {r.get('after_bytes', 0) / 2**20:.0f} MiB "
        f"after ({r.get('growth_pct')}%)",
        f"alive            daemon {al.get('daemon')}, worker {al.get('worker')}, healthy {al.get('healthy')}",
        f"log              {out.get('log', {}).get('traceback_lines')} traceback lines in the daemon's log and stdio",
        f"result           {'OK' if out.get('ok') else 'FAILED'}",
    ]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="ostinato bench reliability", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF to serve (default: the tiny synthetic qwen3moe, written if missing)")
    ap.add_argument("--requests", type=int, default=10000, help="fuzzed HTTP requests (default 10000)")
    ap.add_argument("--control-requests", type=int, default=500, help="fuzzed control-socket requests")
    ap.add_argument("--clients", type=int, default=8, help="concurrent greedy clients")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per greedy client")
    ap.add_argument("--greedy-tokens", type=int, default=8, help="output tokens of each greedy request")
    ap.add_argument("--slow", type=int, default=600, help="half-sent request headers held open")
    ap.add_argument("--kills", type=int, default=3, help="kill -9 of the worker mid-stream")
    ap.add_argument("--stalls", type=int, default=8, help="requests with a 3,000-property tool (schema stall)")
    ap.add_argument("--keepalive", type=int, default=600, help="idle kept-alive connections held open")
    ap.add_argument("--slow-bodies", type=int, default=600, help="connections sending a body a byte every 4 s")
    ap.add_argument("--tool-requests", type=int, default=10000, help="requests with distinct tool definitions")
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None, help="engine CPU threads")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds without an answer that count as a hang")
    ap.add_argument("--deterministic", action="store_true", help="run the daemon with deterministic = true")
    ap.add_argument("--json", help="write the figures to this file")
    a = ap.parse_args(argv)
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        print("ostinato bench reliability needs hypothesis: pip install 'ostinato[test]'", file=sys.stderr)
        return 2
    out = run(a)
    print(report(out))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
