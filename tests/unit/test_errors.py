"""One error base: every exception class of the package derives from ostinatod.errors.OstinatoError
(read from the sources with ast), with one argument order (code, message, status, extra)."""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import pytest

from ostinatod.control.client import ControlAPIError
from ostinatod.engine.types import EngineError
from ostinatod.errors import OstinatoError
from ostinatod.residency.planner import PlanError
from ostinatod.server.errors import ApiError, openai_error_body

PKG = Path(__file__).resolve().parents[2] / "ostinatod"
BUILTIN = {"Exception", "BaseException", "RuntimeError", "ValueError", "OSError", "KeyError",
           "TypeError", "LookupError", "IOError"}


def test_every_exception_class_derives_from_the_base():
    bases: dict[str, set[str]] = {}
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                bases[f"{p.relative_to(PKG)}:{node.name}"] = names
    ours = {k.split(":")[1] for k in bases}

    def derives(names: set[str], seen: frozenset = frozenset()) -> bool:
        if "OstinatoError" in names:
            return True
        return any(derives(v, seen | {k}) for k, v in bases.items()
                   if k.split(":")[1] in names and k not in seen)

    errors = {k: v for k, v in bases.items() if v & BUILTIN or (v & ours and derives(v))}
    assert len(errors) > 15
    bad = [k for k, v in errors.items() if not k.endswith(":OstinatoError") and not derives(v)]
    assert bad == []


def test_one_argument_order_and_fields():
    for cls in (ApiError, EngineError, ControlAPIError):
        e = cls("model_not_found", "no such model", 404)
        assert (e.code, e.message, e.status, e.extra) == ("model_not_found", "no such model", 404, {})
        assert isinstance(e, OstinatoError)
    assert EngineError("x", "y").status == 400  # the engine's default stays
    with pytest.raises(TypeError):  # the order some classes had before: (status, code, message)
        ApiError(400, "invalid_request", "bad")
    assert str(ControlAPIError("busy", "try later", 503)) == "try later (busy)"
    e = PlanError("no routing traces")
    assert isinstance(e, ValueError) and str(e) == "no routing traces" and e.code == "plan_failed"


def test_api_error_takes_param_from_extra_and_keeps_the_body():
    e = ApiError("invalid_request", "bad", 400, extra={"param": "tools", "n_ctx": 8})
    assert openai_error_body(e) == {"error": {"n_ctx": 8, "message": "bad", "type": "invalid_request_error",
                                              "code": "invalid_request", "param": "tools"}}


def test_errors_survive_pickling():
    e = pickle.loads(pickle.dumps(EngineError("context_length_exceeded", "too long", 400, {"n_ctx": 8})))
    assert (type(e), e.code, e.message, e.status, e.extra) == (EngineError, "context_length_exceeded",
                                                               "too long", 400, {"n_ctx": 8})
