"""Pure parts of the engine worker: slot choice (engine/slots.py), stop strings on new text only and
UTF-8 hold-back (engine/text.py), the worker pipe (engine/protocol.py), the sampler's defaults."""

from __future__ import annotations

import random

from ostinatod.engine import protocol as P
from ostinatod.engine.slots import SAME_SESSION_SHARE, Slot, SlotChoice, choose_slot, common_prefix
from ostinatod.engine.text import StopScanner, find_stop, partial_stop_len
from ostinatod.engine.events import DeltaEvent, ErrorEvent, EventType, StartEvent, event_from_data
from ostinatod.engine.types import EngineError, GenRequest
from ostinatod.settings import Settings


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2


def test_choose_slot_continues_the_same_conversation():
    a = Slot(0, tokens=[1, 2, 3, 4, 5, 6, 7, 8], last_used=2.0)
    b = Slot(1, tokens=[9, 9], last_used=1.0)
    # the next turn extends slot 0's conversation: keep all 8 cached tokens, evaluate the rest
    assert choose_slot([a, b], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]) == SlotChoice(target=0, n_keep=8)
    # a re-rendered last turn (differs at the tail, >= SAME_SESSION_SHARE matches): in place
    c = choose_slot([a, b], [1, 2, 3, 4, 5, 6, 70, 80])
    assert 6 >= SAME_SESSION_SHARE * 8 and c == SlotChoice(target=0, n_keep=6)


def test_choose_slot_keeps_the_main_session_for_a_side_request():
    main = Slot(0, tokens=list(range(100)), last_used=5.0)
    free = Slot(1, tokens=[], last_used=1.0)
    # a side request sharing only the system prompt (10 tokens) goes to the LRU free slot, with
    # the shared prefix copied there; the main session's cache stays whole
    c = choose_slot([main, free], list(range(10)) + [500, 501])
    assert c == SlotChoice(target=1, n_keep=10, copy_from=0, n_copy=10)


def test_choose_slot_alone_or_without_gain():
    main = Slot(0, tokens=list(range(100)), last_used=5.0)
    # the only free slot: it is reused, only the common prefix kept
    assert choose_slot([main], list(range(10)) + [7]) == SlotChoice(target=0, n_keep=10)
    # the LRU slot already holds as much of the prompt: no copy
    other = Slot(1, tokens=list(range(10)) + [42], last_used=1.0)
    assert choose_slot([main, other], list(range(10)) + [7]) == SlotChoice(target=1, n_keep=10)
    # at least one prompt token is left to evaluate (logits are needed)
    assert choose_slot([main], list(range(50))).n_keep == 49
    # ties of the match: the most recently used slot
    s1, s2 = Slot(0, [1], last_used=1.0), Slot(1, [1], last_used=2.0)
    assert choose_slot([s1, s2], [1, 2]).target == 0


def test_choose_slot_evicts_the_cheapest_slot_not_the_main_session():
    # main turn (long, used first), a title request (short, used last), then a
    # side request with another system prompt: the title's slot is given up, not the main one
    main = Slot(0, tokens=list(range(2000)), last_used=1.0)
    title = Slot(1, tokens=[5000 + i for i in range(30)], last_used=2.0)
    c = choose_slot([main, title], [9000 + i for i in range(50)])
    assert c.target == 1 and c.n_keep == 0
    # the main session's next turn still finds its whole prefix
    assert choose_slot([main, title], list(range(2000)) + [1, 2]) == SlotChoice(target=0, n_keep=2000)
    # a slot idle for long counts as empty, whatever it holds
    old = Slot(0, tokens=list(range(2000)), last_used=1.0)
    recent = Slot(1, tokens=[5000 + i for i in range(30)], last_used=1000.0)
    assert choose_slot([old, recent], [7], now=1000.0 + 1).target == 0


def test_stop_scanner_matches_the_whole_text_search():
    rng = random.Random(7)
    for _ in range(300):
        stops = ["".join(rng.choice("ab<>") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        sc, text = StopScanner(stops), ""
        while len(text) < 40:
            text += "".join(rng.choice("ab<>x") for _ in range(rng.randint(1, 3)))
            got, want = sc.find(text), find_stop(text, stops)
            assert got == want, (stops, text)
            if want is not None:
                break


def test_stop_scanner_reads_only_new_text():
    sc = StopScanner(["</s>"])
    assert sc.find("x" * 1000) is None
    assert sc._scanned == 1000 and sc.find("x" * 1000 + "</") is None
    assert sc.find("x" * 1000 + "</s>") == 1000
    assert sc.partial_len("abc</") == 2 == partial_stop_len("abc</", ["</s>"])
    assert not StopScanner([]) and not StopScanner([""])


def test_pipe_messages_round_trip():
    req = GenRequest(id="r1", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    msgs = [P.Init(Settings(n_ctx=512), "/m.gguf"), P.Generate(req), P.Cancel("r1"), P.Shutdown(),
            P.CountTokens("7", req), P.SwitchResidency("8", "/s.json", "x"), P.GetStats("9"),
            P.Tokenize("10", ["a", 3], add_special=True, with_pieces=True), P.Detokenize("11", [1, 2]),
            P.ApplyTemplate("12", req), P.FlushTraces("13"), P.Ping("14"),
            P.Event("r1", DeltaEvent(content="é")), P.Reply("7", 12),
            P.Event("r1", ErrorEvent("context_length_exceeded", "long", 400, {"n_ctx": 8})),
            P.Event("r1", StartEvent(3, 1, slot=0))]
    for m in msgs:
        back = P.decode(P.encode(m))
        assert back == m, (m, back)
    assert P.GetStats("9").result_of({"state": "ready"}).state == "ready"   # replies typed by their call
    assert P.CountTokens("7", req).result_of(12) == 12
    assert P.Ping("14").result_of({"steps": 3, "busy": None}).steps == 3
    # a renamed key of an event fails on the daemon's end as an error event of the request, not later
    bad = P.decode('{"op": "event", "id": "r1", "type": "start", "data": {"prompt_tokns": 3}}')
    assert isinstance(bad.event, ErrorEvent) and bad.event.code == "internal_error"
    err = P.decode(P.encode(P.Reply("9", error=EngineError("residency_busy", "busy", 409))))
    assert (err.error.code, err.error.message, err.error.status) == ("residency_busy", "busy", 409)
    st = P.decode('{"op": "state", "state": "error"}')
    assert (st.error.code, st.error.message, st.error.status) == ("model_not_loaded", "load failed", 503)
    assert P.decode("not json") is None and P.decode('{"op": "nope"}') is None


def test_event_types_compare_as_strings():
    ev = event_from_data("done", {})
    assert ev.type is EventType.DONE and ev.type == "done" and f"{ev.type}" == "done"
    assert {"done": 1}[ev.type] == 1


def test_sampling_defaults_come_from_settings():
    from ostinatod.engine.sampling import sampler_params
    from ostinatod.settings import Settings

    s = Settings()
    p = sampler_params(GenRequest(id="x"), s)
    # the values requests got before the defaults moved to Settings (GenRequest's defaults)
    assert (p["temperature"], p["top_p"], p["top_k"], p["min_p"]) == (0.8, 0.95, 40, 0.05)
    p = sampler_params(GenRequest(id="x", temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=-1), s)
    assert (p["temperature"], p["top_p"], p["top_k"], p["min_p"], p["seed"]) == (0.0, 1.0, 0, 0.0, 0xFFFFFFFF)
    p = sampler_params(GenRequest(id="x"), Settings(temperature=0.2, top_p=0.5))
    assert (p["temperature"], p["top_p"]) == (0.2, 0.5)


def test_prefix_cache_budget_lookup_and_covering():
    from ostinatod.engine.prefix_cache import PrefixCache

    pc = PrefixCache(budget=1000, min_tokens=4)
    a, b = list(range(100)), [7] * 50
    assert pc.worth_saving(a, 10) and not pc.worth_saving(a, 98)  # losing 2 tokens is not worth it
    assert pc.put(a, b"x" * 400) and pc.put(b, b"y" * 400)
    assert not pc.worth_saving(a[:60], 0)  # a saved state already holds it
    e, n = pc.best(a[:30] + [999])
    assert e.tokens == a and n == 30
    assert pc.best([1, 2, 3]) is None  # shares under min_tokens
    pc.put(a + [1, 2], b"z" * 300)  # covers `a`: replaces it
    assert [len(x.tokens) for x in pc.entries] == [50, 102]
    pc.put([5] * 10, b"w" * 400)  # over budget: the least recently used goes
    assert [x.tokens[0] for x in pc.entries] == [0, 5] and pc.dropped == 1
    assert not pc.put([1] * 10, b"v" * 2000)  # alone over the budget
    got = pc.take(pc.entries[0], 30)
    assert got == b"z" * 300 and pc.stats()["hits"] == 1 and pc.stats()["restored_tokens"] == 30
