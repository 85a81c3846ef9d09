"""Serves one model over two GPUs, one of them partly taken, and records what the user sees (stage serve2).

Several GPUs on the GPU machine (stage ``serve2`` of scripts/device-run.sh): plan a
residency set over the GPUs as they are now (one of them partly taken by another process, started
by the stage), start the daemon with it, replay a held-out session through its HTTP API, send the
longest development request as one fresh prefill, and record what ``ostinato status``, ``/metrics``
and the TUI show per GPU. Everything but the summary goes into one text file (the device run
brings back few files).

Reuses the benchmark's pieces (ostinatod/bench/bench_*.py): its argument defaults, session split,
development traces (the Ostinato engine in this process, all experts cold), plan (the planner with
the GPUs' free memory from NVML), daemon on loopback and replay client.

Usage: python3 scripts/serve_two_gpus.py --model /tmp/m.gguf --sessions-dir .carry/sessions
       --out-dir $OUT [--gpus 2] [--budget-frac 0.45] [--turns 6] [--hog "1:24"]
Writes <out-dir>/serve2.json (summary; ``ok`` says whether every check held) and serve2.txt.
Exit code 0 when ``ok``, 1 otherwise, 2 when the daemon did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ostinatod.bench import bench_engines  # noqa: E402
from ostinatod.bench.bench_common import BenchError, say  # noqa: E402
from ostinatod.bench.bench_launch import control_metrics, replay, start_daemon  # noqa: E402
from ostinatod.bench.bench_prepare import collect_dev_traces, plan, select_sessions  # noqa: E402
from ostinatod.sessions import WORKLOAD_OF_SESSION, assistant_turns  # noqa: E402

OOM = re.compile(r"out of memory|cudaMalloc|CUDA error|failed to allocate|OOM|GGML_ASSERT|Traceback",
                 re.IGNORECASE)
METRIC_LINES = re.compile(r"^ostinato_(pool_|gpu_memory_|engine_experts_hot_route_share )")


def status_text(home: Path) -> str:
    """``ostinato status`` of the daemon under ``home`` (the CLI, as a user runs it)."""
    env = dict(os.environ, OSTINATO_HOME=str(home))
    p = subprocess.run([sys.executable, "-m", "ostinatod.cli", "status"], env=env, capture_output=True,
                       text=True, timeout=60)
    return p.stdout + p.stderr


def metrics_lines(url: str) -> list[str]:
    """The per-GPU lines of the daemon's Prometheus ``/metrics`` (HTTP, as a scraper reads it)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return [ln for ln in text.splitlines() if METRIC_LINES.match(ln)]


def tui_text(socket: Path, svg: Path) -> str:
    """The TUI, headless (Textual's run_test) against the daemon's control socket, once it has a
    snapshot with the engine ready: its panels as text; a screenshot goes to ``svg``."""
    from ostinatod.ui.tui import OstinatoTUI

    async def run() -> str:
        app = OstinatoTUI(socket=socket, interval=0.5)
        async with app.run_test(size=(170, 50)) as pilot:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (app.snapshot or {}).get("engine_state") != "ready":
                await pilot.pause(0.2)
            await pilot.pause(1.0)  # one more snapshot: the panels have drawn it
            parts = [f"--- #{sel}\n{app.query_one('#' + sel).render()}"
                     for sel in ("status", "share", "paths", "memory")]
            svg.write_text(app.export_screenshot())
            await pilot.press("q")
        return "\n".join(parts)

    return asyncio.run(run())


def engine_numa(daemon_pid: int, model: Path) -> list[dict[str, Any]]:
    """Per process of the daemon's tree: its CPU mask, thread count and, from ``/proc/<pid>/numa_maps``,
    the pages of the model file's mapping per NUMA node (where the CPU branch reads cold experts
    from) and of the anonymous memory. Item 4's question: are the engine's threads and the memory
    they stream on one node?"""
    import psutil

    from ostinatod.cpus import format_cpulist

    out = []
    try:
        procs = [psutil.Process(daemon_pid)] + psutil.Process(daemon_pid).children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        rec: dict[str, Any] = {"pid": p.pid}
        try:
            rec["cmd"] = " ".join(p.cmdline()[:4])
            rec["threads"] = p.num_threads()
            rec["cpus"] = format_cpulist(sorted(os.sched_getaffinity(p.pid)))
            model_pages: dict[str, int] = {}
            anon_pages: dict[str, int] = {}
            for line in Path(f"/proc/{p.pid}/numa_maps").read_text().splitlines():
                into = model_pages if str(model) in line else anon_pages if " anon=" in line else None
                if into is None:
                    continue
                for tok in line.split():
                    if re.fullmatch(r"N\d+=\d+", tok):
                        n, v = tok.split("=")
                        into[n] = into.get(n, 0) + int(v)
            rec["model_pages_per_node"], rec["anon_pages_per_node"] = model_pages, anon_pages
        except (OSError, psutil.Error) as e:
            rec["error"] = str(e)
        out.append(rec)
    return out


def longest_dev_turn(dev: list[dict], dev_turns: int):
    """(session, turn) of the development turn with the longest context among those the traces
    replayed (the first ``dev_turns`` of each dev session): the planner sized the GPUs for it."""
    cands = [(len(json.dumps(t.context)), s, t) for s in dev for t in assistant_turns(s)[:dev_turns]]
    _, s, t = max(cands, key=lambda c: c[0])
    return s, t


def fresh_prefill(url: str, model: str, sess: dict, turn) -> dict[str, Any]:
    """One non-streamed request with the whole context of ``turn`` (nothing of it cached in the
    daemon): the longest prefill the plan was made for. Returns {ok, prompt_tokens, seconds, error}."""
    import openai

    from ostinatod.bench.replay import to_openai, tools_openai

    cl = openai.OpenAI(base_url=url + "/v1", api_key="ostinato", timeout=600, max_retries=0)
    kw: dict[str, Any] = {}
    tools = tools_openai(sess.get("tools") or [])
    if tools:
        kw["tools"] = tools
    t0 = time.perf_counter()
    try:
        r = cl.chat.completions.create(model=model, messages=to_openai(turn.context), max_tokens=8,
                                       temperature=0, **kw)
        return {"ok": True, "prompt_tokens": r.usage.prompt_tokens if r.usage else None,
                "seconds": round(time.perf_counter() - t0, 2), "session": sess["id"], "turn": turn.index}
    except Exception as e:  # noqa: BLE001 - recorded: the check fails
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}",
                "seconds": round(time.perf_counter() - t0, 2), "session": sess["id"], "turn": turn.index}
    finally:
        cl.close()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--sessions-dir", type=Path, required=True)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/serve2-work"))
    ap.add_argument("--gpus", default="2")
    ap.add_argument("--budget-frac", type=float, default=0.45)
    ap.add_argument("--turns", type=int, default=6, help="turns of the held-out session")
    ap.add_argument("--n-ctx", type=int, default=32768)
    ap.add_argument("--hog", default="", help="'GPU:GiB' the stage took before (recorded only)")
    a = ap.parse_args(argv)
    # the benchmark's namespace (its defaults for dev sessions, turns, threads, client, ...)
    b = bench_engines.build_parser().parse_args(
        ["--model", str(a.model), "--sessions-dir", str(a.sessions_dir), "--gpus", a.gpus,
         "--budget-frac", str(a.budget_frac), "--sessions", "1", "--turns", str(a.turns),
         "--n-ctx", str(a.n_ctx), "--work-dir", str(a.work_dir)])
    run_dir = a.work_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    txt = open(a.out_dir / "serve2.txt", "w")

    def note(title: str, body: str) -> None:
        txt.write(f"\n===== {title} =====\n{body.rstrip()}\n")
        txt.flush()

    summary: dict[str, Any] = {"command": "python3 scripts/serve_two_gpus.py " + " ".join(argv),
                               "hog": a.hog, "checks": {}}
    from ostinatod.hardware import detect_gpus

    gpus_now = detect_gpus()
    summary["gpus_at_plan"] = [{"device": g.device, "name": g.name,
                                "free_gib": round((g.free_bytes or 0) / 2**30, 2)} for g in gpus_now]
    workload = WORKLOAD_OF_SESSION.get(Path(b.sessions_file).stem, "coding")
    sessions_file, dev, held = select_sessions(b)
    held = held[:1]
    held_file = run_dir / "held-out.jsonl"
    held_file.write_text("".join(json.dumps(s) + "\n" for s in held))
    say(f"serve2: dev {[s['id'] for s in dev]}, held-out {held[0]['id']}; GPUs {summary['gpus_at_plan']}")
    from ostinatod.residency.planner import read_model_shape

    block = read_model_shape(a.model).model_block()
    trace = collect_dev_traces(a.model.resolve(), block, dev, b, run_dir, workload)
    res, res_path, _ = plan(a.model.resolve(), trace, b, run_dir, workload)
    per_gpu = []
    for g, c in zip(res["gpus"], res["plan"]["capacity"]):
        per_gpu.append({"device": g["device"], "layers": [g["layers"][0], g["layers"][-1]] if g["layers"] else [],
                        "n_layers": len(g["layers"]), "n_hot": c["n_hot"], "pool_bytes": c["pool_bytes"],
                        "budget_bytes": g["budget_bytes"], "capacity_bytes": c["capacity_bytes"],
                        "free_bytes": c["free_bytes"], "need_bytes": c["need_bytes"], "test": c["test"]})
    summary["plan"] = {"path": str(res_path), "per_gpu": per_gpu,
                       "max_request_tokens": res["plan"]["max_request_tokens"],
                       "dev_hot_route_share": res["plan"]["dev_hot_route_share"]}
    slots = [p["n_hot"] for p in per_gpu]
    free = [p["free_bytes"] for p in per_gpu]
    # item 3: the GPU with less free memory gets fewer slots (through fewer layers and/or its cap)
    summary["checks"]["fewer_slots_on_less_free_gpu"] = (
        len(per_gpu) > 1 and None not in free and
        slots[free.index(min(free))] < slots[free.index(max(free))])
    note("plan", json.dumps(summary["plan"], indent=1))

    srv = start_daemon("serve2", a.model.resolve(), {"experts": "ostinato", "residency": res_path}, run_dir, b)
    home = run_dir / "home-serve2"
    try:
        t0 = time.monotonic()
        try:
            url = srv.wait_ready(b.start_timeout)
        except BenchError as e:
            summary["checks"]["daemon_started"] = False
            summary["error"] = str(e)[-2000:]
            note("daemon failed", str(e))
            return 2
        summary["checks"]["daemon_started"] = True
        summary["daemon"] = {"url": url, "load_s": round(time.monotonic() - t0, 1)}
        say(f"serve2: daemon ready at {url} after {summary['daemon']['load_s']} s")
        note("ostinato status (before the replay)", status_text(home))
        mid: dict[str, Any] = {}

        def on_turn() -> None:  # after the first turn: what a user sees while a session runs
            if not mid:
                mid["status"] = status_text(home)
                mid["metrics"] = metrics_lines(url)

        data = replay(url, held_file, held, b, run_dir / "replay-serve2.json", on_turn=on_turn)
        turns = [t for s in data["sessions"] for t in s["turns"]]
        summary["replay"] = {"session": held[0]["id"], "turns": len(turns),
                             "errors": [t.get("error") for t in turns if t.get("error")],
                             "summary": data.get("summary")}
        summary["checks"]["replay_served"] = bool(turns) and not summary["replay"]["errors"]
        note("ostinato status (after turn 1)", mid.get("status", "(no turn)"))
        note("/metrics per-GPU lines (after turn 1)", "\n".join(mid.get("metrics", [])))
        s_dev, t_dev = longest_dev_turn(dev, b.dev_turns)
        model_id = json.loads(urllib.request.urlopen(url + "/v1/models", timeout=30).read())["data"][0]["id"]
        summary["longest_dev_prefill"] = fresh_prefill(url, model_id, s_dev, t_dev)
        summary["checks"]["longest_dev_prefill_ok"] = summary["longest_dev_prefill"]["ok"]
        say(f"serve2: replay {summary['replay']['turns']} turns, errors {len(summary['replay']['errors'])}; "
            f"longest dev prefill {summary['longest_dev_prefill']}")
        st = status_text(home)
        note("ostinato status (after)", st)
        ml = metrics_lines(url)
        note("/metrics per-GPU lines (after)", "\n".join(ml))
        try:
            snap = control_metrics(home)
            pools = ((snap.get("experts") or {}).get("pools")) or []
        except Exception as e:  # noqa: BLE001
            pools, snap = [], {"error": str(e)}
        summary["pools"] = pools
        summary["engine_numa"] = engine_numa(srv.proc.pid, a.model.resolve())
        note("engine processes: CPUs, threads, pages per NUMA node", json.dumps(summary["engine_numa"], indent=1))
        summary["gpu_memory"] = (snap.get("memory") or {}).get("gpus")
        summary["checks"]["status_shows_pools"] = st.count(" hot experts, ") >= 2
        summary["checks"]["metrics_show_pools"] = (
            sum(1 for ln in ml if ln.startswith("ostinato_pool_hot_route_share{")) >= 2)
        try:
            tui = tui_text(home / "run" / "control.sock", a.out_dir / "serve2-tui.svg")
        except Exception as e:  # noqa: BLE001 - recorded: the check fails
            tui = f"TUI failed: {type(e).__name__}: {e}"
        note("TUI panels (headless)", tui)
        summary["checks"]["tui_shows_pools"] = tui.count(" hot experts, ") >= 2
    finally:
        srv.stop()
        logs = sorted(run_dir.rglob("*.log"))
        hits = [f"{p.name}: {ln.strip()}" for p in logs for ln in p.read_text(errors="replace").splitlines()
                if OOM.search(ln)]
        summary["oom_or_error_lines"] = hits[:50]
        summary["checks"]["no_oom"] = not any(re.search(r"out of memory|cudaMalloc|failed to allocate", h,
                                                        re.IGNORECASE) for h in hits)
        tails = "\n".join(f"--- {p}\n" + p.read_text(errors="replace")[-6000:] for p in logs
                          if p.name in ("serve2.log", "ostinatod.log"))
        note("daemon log tails", tails)
        summary["ok"] = all(summary["checks"].values())
        (a.out_dir / "serve2.json").write_text(json.dumps(summary, indent=1, default=str))
        txt.close()
    say(f"serve2: checks {summary['checks']} -> {'ok' if summary['ok'] else 'FAILED'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
