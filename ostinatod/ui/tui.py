"""``ostinato tui``: live terminal UI of a running daemon (Textual), over the control API only.

Shows the hot-route share overall and per layer (a heat strip: one cell per MoE layer, red = most
routes cold, green = all hot), the active residency set (workload, hot experts, swaps) and the last
swap (from -> to, seconds, why: control / auto / replan), TTFT and TPOT of recent requests
(sparklines), the expert-path counts (decode / split / upload), GPU and host memory, active slots
and requests, and the recent requests with their workload (``*`` marks a request whose workload's
set was swapped in before it ran). Keys: ``w`` switch workload, ``p`` re-plan the residency set of the
current workload from its traces, ``l`` load a model, ``q`` quit.

Data comes from ``GET /events`` (one snapshot per ``--interval`` seconds) into the app's reactive
``snapshot`` attribute; every panel binds its own ``snapshot`` to it (``data_bind``) and redraws
itself when it changes, from the pure text builders below. Actions are POSTs. When no daemon
answers, the UI says so (reactive ``notice``) and keeps retrying.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any, Optional

import aiohttp
from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Header, Input, Label, Sparkline, Static

from ..control.client import ControlAPIError, ControlClient, DaemonNotRunning
from ..control.snapshots import pool_lines

GIB = 1 << 30


def heat_color(share: float) -> str:
    """Cell colour for a hot-route share in [0, 1]: red (cold) -> yellow -> green (hot)."""
    s = min(1.0, max(0.0, share))
    r = int(230 * min(1.0, 2 * (1 - s)))
    g = int(200 * min(1.0, 2 * s))
    return f"rgb({r},{g},60)"


def heat_strip(shares: Optional[list[float]], source: Optional[str] = None) -> Text:
    """One coloured block per layer (layer 0 first; two cells wide up to 32 layers); a legend with
    min/mean/max below. ``source``: "engine" (live counters) or "traces" (the set over the
    workload's routing trace)."""
    if not shares:
        return Text("no per-layer figures yet (needs a residency set and routing traces)", style="dim")
    t = Text("per layer" + (f" ({source})" if source else "") + "\n", style="dim")
    cell = "██" if len(shares) <= 32 else "█"
    for s in shares:
        t.append(cell, style=heat_color(s))
    lo, hi = min(shares), max(shares)
    t.append(f"\n{len(shares)} layers   min {lo:.0%}  mean {sum(shares) / len(shares):.0%}  max {hi:.0%}",
             style="dim")
    return t


def residency_line(ex: dict[str, Any], mode: Optional[str] = None) -> str:
    """The active residency set from :func:`ostinatod.control.snapshots.expert_view` (``mode``: the model's
    experts_mode): ``coding set, 96 hot experts, 1.5 MiB, 3 swaps, auto`` (or what is missing)."""
    if mode == "stock" or (ex.get("switches") is None and ex.get("hot_experts") is None):
        return "-  (stock engine: no residency sets)" if mode == "stock" else "-"
    wl = ex.get("workload")
    parts = [f"{wl} set" if wl else "no set (all experts cold)"]
    if ex.get("hot_experts") is not None and wl:
        parts.append(f"{ex['hot_experts']} hot experts")
    if ex.get("pool_bytes"):
        parts.append(f"{ex['pool_bytes'] / (1 << 20):.1f} MiB")
    parts.append(f"{ex.get('switches') or 0} swaps")
    parts.append("auto" if ex.get("auto_switch") else "auto off")
    return ", ".join(parts)


def switch_line(sw: dict[str, Any]) -> str:
    """The last swap: ``swapped coding -> customer-service in 0.004 s (auto)``."""
    to = sw.get("workload") or Path(sw.get("path") or "").stem or "?"
    frm = sw.get("previous_workload") or "none"
    return f"swapped {frm} -> {to} in {float(sw.get('seconds') or 0):.3f} s ({sw.get('reason') or 'control'})"


def bar(used: float, total: float, width: int = 14) -> str:
    """A text bar ``[#####.....] 12.3/24.0 GiB`` (bytes in, GiB shown)."""
    frac = 0.0 if not total else min(1.0, used / total)
    n = int(round(frac * width))
    return f"[{'#' * n}{'.' * (width - n)}] {used / GIB:.1f}/{total / GIB:.1f} GiB"


def status_text(snap: dict[str, Any]) -> Text:
    """The status panel: model, engine state, experts, workload, residency set, requests."""
    m, ex, req = snap.get("model") or {}, snap.get("experts") or {}, snap.get("requests") or {}
    state = snap.get("engine_state")
    style = {"ready": "green", "loading": "yellow", "error": "red"}.get(state, "yellow")
    st = Text()
    st.append("model     ", style="bold")
    st.append(f"{m.get('id', '-')}\n")
    if m.get("is_demo"):
        st.append("          demo model, RANDOM WEIGHTS\n", style="bold yellow")
    st.append("engine    ", style="bold")
    st.append(f"{state}" + (f" ({snap['phase']})" if snap.get("phase") else "") +
              ("  PAUSED" if snap.get("paused") else "") + "\n", style=style)
    health = snap.get("engine_health") or {}
    if health.get("error") and state != "ready":  # why nothing is served (load failure, crashes)
        st.append(f"          {health['error']}\n", style="red")
    elif health.get("restarts"):
        st.append(f"          {health['restarts']} worker restart(s)\n", style="dim")
    st.append("experts   ", style="bold")
    st.append(f"{ex.get('mode') or m.get('experts_mode') or '-'}"
              f"  {m.get('arch') or ''} {m.get('n_layer') or ''}L×{m.get('n_expert') or ''}E k={m.get('n_expert_used') or ''}\n")
    st.append("workload  ", style="bold")
    st.append(f"{snap.get('workload')}", style="cyan")
    src = {"requests": "latest request", "engine": "residency set"}.get(snap.get("workload_source"))
    st.append((f"  ({src})" if src else "") + "\n", style="dim")
    st.append("residency ", style="bold")
    st.append(residency_line(ex, m.get("experts_mode")) + "\n")
    for line in pool_lines(ex.get("pools"), (snap.get("memory") or {}).get("gpus")):   # one per GPU
        st.append("          " + line + "\n", style="dim")
    sw = snap.get("last_residency_switch")
    if sw:
        st.append("          " + switch_line(sw) + "\n", style="yellow" if sw.get("reason") == "auto" else "dim")
    slots = (snap.get("engine") or {}).get("slots") or []
    busy = sum(1 for s in slots if s.get("busy"))
    st.append("requests  ", style="bold")
    st.append(f"{req.get('active', 0)} active, {req.get('total', 0)} total")
    counts = snap.get("workload_counts") or {}
    if len(counts) > 1:
        st.append("  (" + ", ".join(f"{w} {n}" for w, n in counts.items()) + ")", style="dim")
    if slots:
        st.append(f"   slots {busy}/{len(slots)} busy")
    return st


def share_text(ex: dict[str, Any]) -> Text:
    """``hot-route share  84.0%   840/1000 routes hot``."""
    share = ex.get("hot_route_share")
    txt = Text("hot-route share  ", style="bold")
    txt.append("-" if share is None else f"{share:.1%}", style="bold green" if share else "dim")
    if ex.get("routes"):
        txt.append(f"   {ex.get('hot_routes') or 0}/{ex['routes']} routes hot", style="dim")
    return txt


def paths_text(ex: dict[str, Any]) -> Text:
    """Forward passes by path (decode, split, upload, stock)."""
    paths = ex.get("paths") or {}
    pt = Text("forward passes by path\n", style="bold")
    for k in ("decode", "split", "upload", "stock"):
        pt.append(f"  {k:<7}{paths.get(k, 0):>10,}\n")
    return pt


def memory_text(mem: dict[str, Any]) -> Text:
    """Host memory, daemon + engine RSS and each GPU's memory."""
    host = mem.get("host") or {}
    mt = Text("memory\n", style="bold")
    tot = host.get("total_bytes") or 0
    mt.append(f"  host {bar(tot - (host.get('available_bytes') or 0), tot)}\n")
    mt.append(f"  daemon+engine RSS {(host.get('daemon_rss_bytes') or 0) / GIB:.2f} GiB\n")
    for g in mem.get("gpus") or []:
        mt.append(f"  GPU{g['index']} {bar(g['used_bytes'], g['total_bytes'])}\n")
    if not mem.get("gpus"):
        mt.append("  no NVIDIA GPU\n", style="dim")
    return mt


def request_rows(req: dict[str, Any], limit: int = 50) -> list[tuple[str, ...]]:
    """Rows of the requests table: active requests first, then the recent ones, newest first."""
    def f(v, p=3):
        return "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))
    rows = list(req.get("active_list") or []) + list(reversed(req.get("recent") or []))
    out = []
    for r in rows[:limit]:
        wl = f(r.get("workload")) + (" *" if r.get("residency_switch_s") is not None else "")
        out.append((str(r.get("id"))[:24], wl, f(r.get("client")), f(r.get("status")),
                    f(r.get("prompt_tokens")), f(r.get("cached_tokens")), f(r.get("completion_tokens")),
                    f(r.get("ttft_s")), f(r.get("tpot_s"), 4)))
    return out


# --- panels: each redraws itself from the app's reactive snapshot ---------------------------------

class StatusPanel(Static):
    """Model, engine, workload, residency; or the ``notice`` when the daemon is away."""

    snapshot: reactive[dict] = reactive(dict, always_update=True)
    notice: reactive[Optional[Text]] = reactive(None, always_update=True)

    def watch_snapshot(self, snap: dict[str, Any]) -> None:
        if snap:
            self.update(status_text(snap))

    def watch_notice(self, notice: Optional[Text]) -> None:
        if notice is not None:
            self.update(notice)


class SharePanel(Static):
    snapshot: reactive[dict] = reactive(dict, always_update=True)

    def watch_snapshot(self, snap: dict[str, Any]) -> None:
        self.update(share_text(snap.get("experts") or {}))


class HeatPanel(Static):
    snapshot: reactive[dict] = reactive(dict, always_update=True)

    def watch_snapshot(self, snap: dict[str, Any]) -> None:
        if snap:
            ex = snap.get("experts") or {}
            self.update(heat_strip(ex.get("per_layer_hot_share"), ex.get("per_layer_source")))


class LatencyPanel(Vertical):
    """A sparkline of one per-request time (``key``: "ttft_s" or "tpot_s") with its label."""

    snapshot: reactive[dict] = reactive(dict, always_update=True)

    def __init__(self, key: str, name: str, digits: int, **kw: Any):
        super().__init__(**kw)
        self.key, self.title, self.digits = key, name, digits

    def compose(self) -> ComposeResult:
        base = (self.id or self.key).removesuffix("-panel")
        yield Label(f"{self.title} of recent requests (s)", id=f"{base}-label")
        yield Sparkline([], id=base)

    def watch_snapshot(self, snap: dict[str, Any]) -> None:
        if not snap or not self.is_mounted:
            return
        recent = (snap.get("requests") or {}).get("recent") or []
        vals = [r[self.key] for r in recent if r.get(self.key) is not None]
        self.query_one(Sparkline).data = vals or [0.0]
        d = self.digits
        self.query_one(Label).update(f"{self.title} (s)  last {vals[-1]:.{d}f}  max {max(vals):.{d}f}"
                                     if vals else f"{self.title} (s)  no requests yet")


class PathsPanel(Static):
    snapshot: reactive[dict] = reactive(dict, always_update=True)

    def watch_snapshot(self, snap: dict[str, Any]) -> None:
        if snap:
            self.update(paths_text(snap.get("experts") or {}))


class MemoryPanel(Static):
    snapshot: reactive[dict] = reactive(dict, always_update=True)

    def watch_snapshot(self, snap: dict[str, Any]) -> None:
        if snap:
            self.update(memory_text(snap.get("memory") or {}))


class RequestsTable(DataTable):
    snapshot: reactive[dict] = reactive(dict, always_update=True)

    def on_mount(self) -> None:
        self.add_columns("id", "workload", "client", "status", "prompt", "cached", "out", "TTFT s", "TPOT s")

    def watch_snapshot(self, snap: dict[str, Any]) -> None:
        if not snap or not self.columns:
            return
        self.clear()
        for row in request_rows(snap.get("requests") or {}):
            self.add_row(*row)


class PromptScreen(ModalScreen[Optional[str]]):
    """A one-line question; dismisses with the text, or None on Escape."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, question: str, value: str = "", hint: str = ""):
        super().__init__()
        self.question, self.value, self.hint = question, value, hint

    def compose(self) -> ComposeResult:
        with Vertical(id="prompt"):
            yield Label(self.question)
            yield Input(value=self.value, id="prompt-input")
            if self.hint:
                yield Label(self.hint, classes="hint")

    @on(Input.Submitted)
    def submitted(self, ev: Input.Submitted) -> None:
        self.dismiss(ev.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class OstinatoTUI(App):
    """The live view. ``socket``: control socket (default: this user's daemon); ``interval``:
    seconds between snapshots. ``snapshot`` (reactive) is the latest ``/events`` snapshot; the
    panels are bound to it."""

    CSS_PATH = "tui.tcss"
    TITLE = "Ostinato"
    BINDINGS = [
        Binding("w", "switch_workload", "switch workload"),
        Binding("p", "plan", "re-plan"),
        Binding("l", "load_model", "load model"),
        Binding("q", "quit", "quit"),
    ]

    snapshot: reactive[dict] = reactive(dict, always_update=True, init=False)
    notice: reactive[Optional[Text]] = reactive(None, always_update=True, init=False)

    def __init__(self, socket: Optional[Path] = None, interval: float = 1.0):
        super().__init__()
        self.socket = socket
        self.interval = interval
        self.snapshots_seen = 0
        self.last_action: Optional[str] = None  # text of the last action's result (tests read it)

    # --- layout -----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        bound = OstinatoTUI.snapshot
        yield Header(show_clock=True)
        with Horizontal(id="top"):
            yield StatusPanel("connecting…", id="status", classes="panel").data_bind(
                bound, notice=OstinatoTUI.notice)
            with Vertical(id="share-panel", classes="panel"):
                yield SharePanel("hot-route share  -", id="share").data_bind(bound)
                yield HeatPanel("", id="heat").data_bind(bound)
        with Horizontal(id="middle"):
            yield LatencyPanel("ttft_s", "TTFT", 3, id="ttft-panel", classes="panel").data_bind(bound)
            yield LatencyPanel("tpot_s", "TPOT", 4, id="tpot-panel", classes="panel").data_bind(bound)
            yield PathsPanel("", id="paths", classes="panel").data_bind(bound)
            yield MemoryPanel("", id="memory", classes="panel").data_bind(bound)
        yield RequestsTable(id="requests", zebra_stripes=True, cursor_type="row").data_bind(bound)
        yield Footer()

    def on_mount(self) -> None:
        self.follow()

    # --- live data ----------------------------------------------------------------------------
    @work(exclusive=True, group="events")
    async def follow(self) -> None:
        """Consume /events forever; reconnect every 2 s while the daemon is away."""
        while True:
            try:
                async with ControlClient(self.socket) as c:
                    async for snap in c.events(interval=self.interval):
                        self.render_snapshot(snap)
            except DaemonNotRunning as e:
                self.notice = Text(str(e), style="bold red")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # dropped stream, bad line, …: say so and reconnect
                self.notice = Text(f"control API: {type(e).__name__}: {e}; reconnecting", style="red")
            await asyncio.sleep(2)

    def render_snapshot(self, snap: dict[str, Any]) -> None:
        """Take one ``/events`` snapshot (see ostinatod.control.snapshots.metrics_snapshot): the
        bound panels redraw themselves."""
        if "engine_state" not in snap:  # the daemon could not build this snapshot
            self.notice = Text(f"daemon: {snap.get('error')}", style="red")
            return
        self.snapshot = snap
        self.snapshots_seen += 1

    # --- actions ------------------------------------------------------------------------------
    async def _post(self, path: str, body: dict, ok: str) -> Optional[dict]:
        try:
            async with ControlClient(self.socket) as c:
                d = await c.post(path, body)
        except (ControlAPIError, DaemonNotRunning, aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.last_action = f"error: {e}"
            self.notify(str(e), title=path, severity="error", timeout=8)
            return None
        self.last_action = ok.format(**d)
        self.notify(self.last_action, title=path)
        return d

    def action_switch_workload(self) -> None:
        cur = self.snapshot.get("workload") or ""

        async def done(value: Optional[str]) -> None:
            if value:
                await self._post("/residency/switch", {"workload": value},
                                 "workload {workload}: residency set switched in {seconds:.3f} s")
        self.push_screen(PromptScreen("Switch to workload:", cur, "e.g. coding, customer-service; "
                                      "the set must have been planned (p)"), done)

    @work(exclusive=True, group="plan")
    async def action_plan(self) -> None:
        wl = self.snapshot.get("workload")
        self.notify(f"planning the residency set for {wl}…")
        await self._post("/residency/plan", {"workload": wl} if wl else {},
                         "planned {workload}: {path}")

    def action_load_model(self) -> None:
        cur = (self.snapshot.get("model") or {}).get("path") or ""

        async def done(value: Optional[str]) -> None:
            if value:
                self.notify(f"loading {value}…")
                await self._post("/models/load", {"path": str(Path(value).expanduser())},
                                 "loaded {state}")
        self.push_screen(PromptScreen("Load model (GGUF path):", cur), done)


def main(argv: list[str] | None = None) -> int:
    """``ostinato tui [--interval S] [--socket PATH]``."""
    ap = argparse.ArgumentParser(prog="ostinato tui", description="Live terminal UI of the daemon.")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between updates")
    ap.add_argument("--socket", type=Path, help="control socket (default: this user's daemon)")
    a = ap.parse_args(argv)
    OstinatoTUI(a.socket, a.interval).run()
    return 0
