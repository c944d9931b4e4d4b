"""``python -m bloomery_jax.inspect``: the placement numbers add up to the file's tensor bytes."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.inspect import main, role_by_name
from bloomery_jax.quant import row_bytes

SHAPE = dict(n_layers=4, n_experts=16, n_experts_used=4, expert_ff=256)


def run_json(path, capsys) -> dict:
    assert main([str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def q4km(synth_model):
    return synth_model(qtype="Q4_K_M", **SHAPE)


def test_numbers_add_up_to_the_tensor_bytes(q4km, capsys):
    path, report = q4km
    s = run_json(path, capsys)
    gf = GGUFFile(path)
    total = sum(t.n_bytes for t in gf)
    assert s["tensor_bytes"] == total == sum(report.bytes_per_type.values())
    assert s["bytes_per_type"] == report.bytes_per_type
    assert sum(s["bytes_per_role"].values()) == total
    assert s["card_bytes"] + s["host_eligible_bytes"] == total
    assert s["n_params"] == report.n_params and s["roles_from"] == "qwen3moe tensor_specs"
    moe = s["moe"]
    assert moe["n_experts"] == 16 and moe["n_experts_used"] == 4 and moe["n_expert_layers"] == 4
    assert moe["all_experts_bytes"] == s["host_eligible_bytes"] == sum(r["all_experts_bytes"] for r in moe["layers"])
    exps = {t.name: t for t in gf if t.name.endswith("_exps.weight")}
    assert s["host_eligible_bytes"] == sum(t.n_bytes for t in exps.values())
    for r in moe["layers"]:
        assert r["one_expert_bytes"] * r["n_experts"] == r["all_experts_bytes"]
        # one expert = one [F, D] slice of gate and up plus one [D, F] slice of down
        want = sum(row_bytes(t.qtype, t.shape[2]) * t.shape[1]
                   for n, t in exps.items() if n.startswith(f"blk.{r['layer']}."))
        assert r["one_expert_bytes"] == want


def test_q4_k_m_layers_differ_in_expert_size(q4km, capsys):
    moe = run_json(q4km[0], capsys)["moe"]
    # use_more_bits(i, 4) picks layers 2 and 3: their ffn_down_exps are Q6_K, so bigger
    sizes = [r["one_expert_bytes"] for r in moe["layers"]]
    assert sizes[0] == sizes[1] < sizes[2] == sizes[3]
    assert moe["layers"][2]["types"]["ffn_down_exps"] == "Q6_K"


def test_text_report(q4km, capsys):
    assert main([q4km[0]]) == 0
    out = capsys.readouterr().out
    assert "qwen3moe" in out and "one expert (gate+up+down)" in out and "may live on the host" in out


def test_unregistered_architecture_uses_name_patterns(tmp_path, capsys):
    p = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(p), "someothermoe")
    f32 = lambda *s: np.zeros(s, np.float32)
    for name, arr in [("token_embd.weight", f32(10, 32)), ("output_norm.weight", f32(32)),
                      ("blk.0.attn_q.weight", f32(32, 32)), ("blk.0.ffn_gate_inp.weight", f32(4, 32)),
                      ("blk.0.ffn_gate_exps.weight", f32(4, 8, 32)), ("blk.0.ffn_up_exps.weight", f32(4, 8, 32)),
                      ("blk.0.ffn_down_exps.weight", f32(4, 32, 8)), ("blk.0.ffn_up_shexp.weight", f32(8, 32))]:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    s = run_json(p, capsys)
    assert s["roles_from"] == "name patterns"
    assert s["bytes_per_role"]["shared_expert"] == 8 * 32 * 4  # on the card
    assert s["host_eligible_bytes"] == 3 * 4 * 8 * 32 * 4
    assert s["moe"]["layers"][0]["one_expert_bytes"] == 3 * 8 * 32 * 4
    assert s["card_bytes"] + s["host_eligible_bytes"] == s["tensor_bytes"]


@pytest.mark.parametrize("name,role", [
    ("blk.3.ffn_gate_exps.weight", "expert"), ("blk.3.ffn_down_shexp.weight", "shared_expert"),
    ("blk.3.ffn_gate_inp.weight", "router"), ("blk.3.exp_probs_b.bias", "router"),
    ("blk.3.attn_kv_a_norm.weight", "norm"), ("blk.3.attn_kv_b.weight", "attn"),
    ("token_embd.weight", "embed"), ("output.weight", "output"), ("blk.0.ffn_down.weight", "ffn"),
])
def test_role_by_name(name, role):
    assert role_by_name(name) == role


def test_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 40)
    assert main([str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(bad) in err and "\n" not in err
