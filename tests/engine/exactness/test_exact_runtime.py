"""The expert engine through ExpertRuntime and its native stats: consistent counters, a set of
another model refused, a load end to end, the stock setting and configuration errors (harness:
exact_helpers.py)."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest

from ostinatod.engine import native, placement, runtime
from ostinatod.engine.options import c_struct, split_fields  # noqa: E402
from ostinatod.residency.sets import ResidencyError, make_residency, write_residency
from ostinatod.settings import Settings
from exact_helpers import _opt, PROMPT_LEN, _prompt, _stats, _switch, drop_ost, half_hot, llama_cpp, ost_runner
from exact_helpers import _daemon_pool_layout, _free_shared_runner, moe  # noqa: F401 (fixtures)


def test_stats_are_consistent(moe):
    hot = half_hot(moe)
    r = ost_runner(moe)
    _switch(hot)
    _opt(prefill_threshold=16)
    native.llama_fn("ostinato_experts_reset_stats")()
    r.all_logits = True
    try:
        native.llama_fn("ostinato_experts_take_request_stats")()
        r.generate(_prompt(PROMPT_LEN), 3)
        st = _stats(1)
        req = json.loads(native.llama_fn("ostinato_experts_take_request_stats")().decode())
        again = json.loads(native.llama_fn("ostinato_experts_take_request_stats")().decode())
    finally:
        r.all_logits = False
        _opt(prefill_threshold=512)
    k, L, n_exp = moe[1]["n_expert_used"], len(moe[2]), moe[1]["n_expert"]
    n_tok = PROMPT_LEN + 3
    assert st["tokens"] == n_tok and st["passes"] == 4
    assert st["hot_routes"] + st["cold_routes"] == st["routes"] == n_tok * k * L
    cp, cd = np.array(st["counts_prefill"]), np.array(st["counts_decode"])
    assert cp.shape == cd.shape == (moe[1]["n_layer"], n_exp)
    assert cp.sum() == PROMPT_LEN * k * L and cd.sum() == 3 * k * L
    hot_mask = np.zeros_like(cp, dtype=bool)
    for il, ids in hot.items():
        hot_mask[il, ids] = True
    assert (cp + cd)[hot_mask].sum() == st["hot_routes"]
    for p in st["last_passes"]:
        assert p["hot_routes"] + p["cold_routes"] == p["routes"] == p["tokens"] * k * L
        assert p["distinct_cold_experts"] <= min(p["cold_routes"], L * (n_exp - n_exp // 2))
    assert [p["path"] for p in st["last_passes"]] == ["upload", "decode", "decode", "decode"]
    # the prompt's pass (>= 9 tokens) computed its GPU routes over pool views, decode steps did not
    assert [p["pool_views"] for p in st["last_passes"]] == [True, False, False, False]
    assert req["routes"] == st["routes"] and np.array(req["counts_prefill"]).sum() == cp.sum()
    assert again["routes"] == 0 and again["passes"] == 0


def test_runtime_refuses_other_models_set(moe, tmp_path):
    other = dict(moe[1], fingerprint="0" * 64, name="other")
    p = write_residency(make_residency(other, {moe[2][0]: [0]}), tmp_path / "other.json")
    from ostinatod.settings import Settings
    with pytest.raises(ResidencyError, match="fingerprint"):
        runtime.ExpertRuntime.prepare(moe[0], Settings(residency=p))


def test_runtime_end_to_end(moe, tmp_path, monkeypatch):
    """prepare -> load -> info/stats -> switch, as the engine worker calls it."""
    from ostinatod.settings import Settings
    drop_ost()
    monkeypatch.setenv("OSTINATO_HOME", str(tmp_path / "home"))
    path, info_m, layers = moe
    p = write_residency(make_residency(info_m, half_hot(moe)), tmp_path / "a.json")
    rt = runtime.ExpertRuntime.prepare(path, Settings(residency=p, prefill_threshold=4))
    assert rt is not None
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = rt.load(path, mp)  # checks that the loader built the pool
    assert model
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = 128
    ctx = llama_cpp.llama_init_from_model(model, cp)
    batch = llama_cpp.llama_batch_init(8, 0, 1)
    try:
        info = rt.info()
        assert info["hot_experts"] == sum(len(v) for v in half_hot(moe).values())
        assert info["moe_layers"] == len(layers)
        assert info["size_classes"][0]["zero_slots"] == info_m["n_expert_used"]
        all_hot = {il: list(range(info_m["n_expert"])) for il in layers}
        p2 = write_residency(make_residency(info_m, all_hot), tmp_path / "b.json")
        secs = rt.switch(p2)
        assert secs >= 0 and rt.info()["hot_experts"] == len(layers) * info_m["n_expert"]

        def step(tok: int, pos: int):
            batch.n_tokens = 1
            batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = 1000 + tok, pos, 1, 1
            batch.seq_id[0][0] = 0
            return batch
        st0 = rt.stats()
        assert st0["decode_prefetch_choice"]["experts"] == rt.options.decode_prefetch_experts == 2
        assert st0["decode_prefetch_choice"]["source"] == "settings"
        assert llama_cpp.llama_decode(ctx, step(0, 0)) == 0
        llama_cpp.llama_synchronize(ctx)   # the count op's table is read as the device has it
        st = rt.stats()   # every layer all-resident: its routes come from the count op at this call
        assert st["cold_routes"] == st0["cold_routes"] and st["hot_routes"] > st0["hot_routes"]
        # one-token steps' context threads: 1 only where the decode graph serves them (its own
        # pool runs the CPU branch); here every layer is on the CPU (n_gpu_layers 0)
        assert rt.context_decode_threads(6, 0) == 6
        rt.decode_threads = 3
        assert rt.context_decode_threads(6, 0) == 3 and rt.context_decode_threads(2, 0) == 2
        assert rt.context_decode_threads(6, -1, graph=False) == 3
        assert rt.context_decode_threads(6, -1, graph=True) == (1 if native.has_gpu() else 3)
        rt.decode_threads = None
        assert rt.info()["decode_graph"]["failed"] is False and not rt.info()["decode_graph"]["broken"]
        # the context's one-token threads follow what ran: as if the loader had given them 1 for
        # the graph, a step without it gets the batch count back, a step in the graph 1 again; a
        # request without one-token steps changes nothing
        rt.context_threads, rt.follows_graph = (1, 2), True
        assert rt.follow_decode_graph(ctx, {"paths": {"decode": 0, "upload": 1}}) is False
        rt.take_request_stats()
        # every layer is all-resident, its dense part on the CPU (n_gpu_layers 0; the pool may be on
        # a GPU): host work, not a decode-graph step even with the graph on; the route op's path
        # (resident path off) takes the graph when it is on
        try:
            _opt(decode_graph=True, decode_graph_max_tokens=32)
            assert llama_cpp.llama_decode(ctx, step(1, 1)) == 0
            assert rt.take_request_stats()["decode_graph_steps"] == 0
            _opt(resident_path=False)
            _opt(decode_graph=False)
            assert llama_cpp.llama_decode(ctx, step(2, 2)) == 0
            st = rt.take_request_stats()
            assert st["paths"]["decode"] == 1 and st["decode_graph_steps"] == 0
            assert rt.follow_decode_graph(ctx, st) is True and rt.context_threads == (2, 2)
            assert llama_cpp.llama_n_threads(ctx) == 2
            _opt(decode_graph=True, decode_graph_max_tokens=32)
            assert llama_cpp.llama_decode(ctx, step(3, 3)) == 0
            st = rt.take_request_stats()
        finally:
            _opt(decode_graph=None)
            _opt(resident_path=True)
        assert st["decode_graph_steps"] == 1
        assert rt.follow_decode_graph(ctx, st) is True and rt.context_threads == (1, 2)
        assert llama_cpp.llama_n_threads(ctx) == 1
        assert rt.follow_decode_graph(ctx, {"error": "stats failed"}) is False
    finally:
        llama_cpp.llama_batch_free(batch)
        rt.close()
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    assert not native.experts_active()


def test_stock_setting_returns_none(moe):
    from ostinatod.settings import Settings
    assert runtime.ExpertRuntime.prepare(moe[0], Settings(experts="stock")) is None


def test_bad_config_is_a_clear_error(moe):
    with pytest.raises(native.ExpertEngineError, match="force_path"):
        native.check_experts_config(placement.experts_config({0: [1]}, force_path="sideways"))
    with pytest.raises(ValueError):
        _opt(prefill_threshold=0)
    # the native engine checks the struct itself (a caller without EngineOptions' validation)
    r = ost_runner(moe)
    bad = c_struct(native.engine_options())
    bad.decode_prefetch_experts = 17
    assert native.llama_fn("ostinato_experts_reconfigure")(ctypes.byref(bad)) == -1
    assert "decode_prefetch_experts" in native.experts_error()
    assert r.model and native.engine_options().decode_prefetch_experts == 0   # nothing changed


def test_engine_options_reach_the_engine_field_by_field(moe):
    """EngineOptions' C struct (generated from its fields) lands in the native struct field by field:
    each changed value shows in the engine's info under its own name, and reads back the same."""
    r = ost_runner(moe)
    assert r.model
    was = native.engine_options()
    new = was.with_(prefill_threshold=77, force_path="split", decode_overlap=False, decode_graph=False,
                    decode_graph_max_tokens=48, decode_borrow=False, pool_views=False, hybrid_rows=9,
                    upload_copy_2d=False, upload_cpu_share=0.25, decode_prefetch_experts=3,
                    decode_prefetch_copy_blocks=5, cpu_branch_kernel=False, cpu_branch_spins=300,
                    cpu_branch_claims=False, cpu_branch_prefetch_rows=4, cpu_branch_row_pairs="avx2",
                    **split_fields({"alpha_us": 1.5, "cpu_gbps": 2.5, "h2d_gbps": 3.5}))
    try:
        native.reconfigure(new)
        assert native.engine_options() == new
        info = native.experts_json("ostinato_experts_info")
        assert (info["prefill_threshold"], info["force_path"], info["overlap"]) == (77, "split", False)
        dg = info["decode_graph"]
        assert (dg["mode"], dg["max_tokens"], dg["prefetch"]) == ("off", 48, {"max_experts": 3, "copy_blocks": 5})
        pre = info["prefill"]
        assert (pre["pool_views"], pre["hybrid_rows"], pre["copy_2d"], pre["upload_cpu_share"]) == (False, 9, False, 0.25)
        assert info["borrowed"]["on"] is False
        assert info["cpu_team"] == {"spins": 300, "claims": False, "prefetch_rows": 4, "row_pairs": 1}
        native.reconfigure(new.with_(upload_cpu_share=0.0))
        assert native.experts_json("ostinato_experts_info")["prefill"]["cpu_split"] == \
            {"alpha_us": 1.5, "cpu_gbps": 2.5, "h2d_gbps": 3.5}
    finally:
        native.reconfigure(was)
    assert native.experts_json("ostinato_experts_info")["cpu_team"]["spins"] == was.cpu_branch_spins
