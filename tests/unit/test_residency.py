"""Residency-set files and the model fingerprint (ostinatod/engine/residency.py). No native code."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ostinatod.residency.sets import (ResidencyError, make_residency, model_block,  # noqa: E402
                                        model_fingerprint, read_residency, validate_residency,
                                        write_residency)


def _write(path, n_expert=4, n_ff=8, name="m"):
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name(name)
    w.add_block_count(1)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(2)
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((n_expert, n_ff, 16), np.float32))
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((n_expert, 16), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp")
    a = _write(d / "a.gguf")
    b = _write(d / "b.gguf", n_ff=12)
    return a, b


def test_fingerprint_is_path_independent_and_shape_sensitive(models, tmp_path):
    a, b = models
    copy = tmp_path / "renamed.gguf"
    shutil.copy(a, copy)
    assert model_fingerprint(copy) == model_fingerprint(a)
    assert model_fingerprint(a) != model_fingerprint(b)
    m = model_block(a)
    assert (m["arch"], m["n_layer"], m["n_expert"], m["n_expert_used"]) == ("qwen3moe", 1, 4, 2)


def test_roundtrip_and_hot_sets(models, tmp_path):
    a, _ = models
    m = model_block(a)
    doc = make_residency(m, {0: [3, 1]})
    p = write_residency(doc, tmp_path / "r" / "coding.json")
    rs = read_residency(p, m)
    assert rs.hot == {0: {0: [1, 3]}} and rs.n_hot == 2 and rs.hot_all() == {0: [1, 3]}


def test_other_model_refused(models, tmp_path):
    a, b = models
    p = write_residency(make_residency(model_block(a), {0: [0]}), tmp_path / "a.json")
    with pytest.raises(ResidencyError, match="fingerprint"):
        read_residency(p, model_block(b))


@pytest.mark.parametrize("mutate, msg", [
    (lambda d: d.update(format="x"), "not an ostinato-residency/1"),
    (lambda d: d["gpus"][0]["hot"].update({"5": [0]}), "layer 5 out of range"),
    (lambda d: d["gpus"][0]["hot"].update({"0": [9]}), "expert id outside"),
    (lambda d: d["gpus"][0]["hot"].update({"x": [0]}), "not an integer"),
    (lambda d: d.update(gpus=[]), "non-empty"),
])
def test_bad_documents(models, mutate, msg):
    m = model_block(models[0])
    d = json.loads(json.dumps(make_residency(m, {0: [0]})))
    mutate(d)
    with pytest.raises(ResidencyError, match=msg):
        validate_residency(d, m)


def test_unreadable_files(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{")
    with pytest.raises(ResidencyError, match="not JSON"):
        read_residency(bad)
    with pytest.raises(ResidencyError, match="not found"):
        model_fingerprint(tmp_path / "missing.gguf")
