"""``ostinato bench engines --budget-sweep``: the budgets, their plans and the ``sweep`` block of the
result (the Ostinato engine at each pool budget; the baselines and the limit run once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from .bench_common import LIMIT, parse_list, say
from .bench_prepare import plan
from .bench_report import ratios, ratios_vs_limit


def parse_budgets(text: Optional[str]) -> list[float]:
    """``"0.25,0.45"`` -> [0.25, 0.45] (sorted, unique); BenchError outside (0, 1]."""
    return parse_list(text, "--budget-sweep", "fractions", lambda x: 0 < x <= 1, "(0, 1]")


def sweep_tag(frac: float) -> str:
    return f"ostinato-b{round(frac * 100):02d}"


def plan_sweep(model: Path, trace, a, run_dir: Path, workload: str, sweep: list[float],
               plans: dict[float, tuple], notes: list[str]) -> None:
    """Plan every budget of ``sweep`` not in ``plans`` yet (``plans[b]``: what :func:`plan`
    returns); a budget the planner refuses leaves ``sweep``, with a note."""
    for b in list(sweep):
        if b not in plans:
            try:
                plans[b] = plan(model, trace, a, run_dir, workload, budget_frac=b,
                                file_name=f"residency-{sweep_tag(b)}.json")
            except ValueError as e:  # PlanError: e.g. the capacity test leaves no room
                notes.append(f"{sweep_tag(b)}: no plan at {b:.0%}: {e}; budget left out of the sweep")
                say(notes[-1])
                sweep.remove(b)


def sweep_block(a, sweep, sweep_runs, plans, results) -> dict[str, Any]:
    runs = []
    for b in sweep:
        res, _, st = plans[b]
        m = sweep_runs.get(b)
        keep = ("decode_ms_per_token", "ttft_after_tool_median_s", "ttft_after_user_median_s",
                "ttft_median_s", "session_total_s", "hot_route_share", "prefill_by_new_tokens",
                "turns", "errors", "load_s", "step_breakdown")
        runs.append({"budget_frac": b, "pool_bytes": res["plan"]["pool_bytes_total"],
                     "dev_hot_route_share": res["plan"]["dev_hot_route_share"],
                     "stock_n_cpu_moe_at_equal_memory": st["n_cpu_moe"],
                     "ostinato": {k: m.get(k) for k in keep} if m else None,
                     "ratios_vs_limit": ratios_vs_limit(results, m) if m else None,
                     "ratios_vs_baselines": ratios(results, m) if m else None})
    return {"budgets": sweep, "baselines_budget_frac": a.budget_frac,
            "note": f"stock baselines and {LIMIT} ran once; the baselines hold the GPU memory of the "
                    f"{a.budget_frac:.0%} pool, so ratios_vs_baselines compare at equal memory only "
                    f"at that budget",
            "runs": runs}
