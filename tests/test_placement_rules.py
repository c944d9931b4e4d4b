"""Placement rules: every rule on a Qwen3-30B-A3B-sized layout from numbers and on a small synthetic
file, budget edges and sizes, llama.cpp-style overrides, strict parsing, a model without experts,
and gin selecting a rule."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np
import pytest
from gguf import GGUFWriter

from bloomery_jax.errors import ConfigError
from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.models import gemma3
from bloomery_jax.models.registry import module_for_file
from bloomery_jax.placement import (RULES, Budget, Card, CardExperts, CpuMoe, ExpertLayout, LastCpuMoe, NCpuMoe, Override,
                                    PlacementRule, all_card, describe, parse_rule, parse_size, register_rule)
from bloomery_jax.settings import load_settings

GiB, MiB = 1 << 30, 1 << 20
# Qwen3-30B-A3B Q4_K_M-like: D=2048, F=768; gate/up Q4_K (144 B per 256), down Q6_K (210 B per 256).
ONE_EXPERT = 2 * 768 * 2048 // 256 * 144 + 2048 * 768 // 256 * 210  # 3,059,712 B
FIXED = 1_300_000_000
SYNTH = dict(qtype="Q4_K_M", n_layers=4, n_experts=16, n_experts_used=4, expert_ff=256)  # as test_inspect


@pytest.fixture(scope="module")
def big() -> ExpertLayout:
    return ExpertLayout.from_numbers(48, 128, ONE_EXPERT, FIXED)


@pytest.fixture(scope="module")
def synth(synth_model):
    path, _ = synth_model(**SYNTH)
    gf = GGUFFile(path)
    module = module_for_file(gf)
    return gf, ExpertLayout.from_file(gf, module.tensor_specs(module.Config.from_gguf(gf)))


def host_rows(on_card) -> list[int]:
    return [i for i, row in enumerate(on_card) if not row.any()]


# --- the layout ----------------------------------------------------------------------------------


def test_layout_from_file_matches_the_tensor_table(synth):
    gf, lay = synth
    assert lay.shape == (4, 16) and lay.moe_layers == (0, 1, 2, 3)
    exps = {t.name: t for t in gf if t.name.endswith("_exps.weight")}
    for i in range(4):
        assert lay.expert_names[i] == tuple(f"blk.{i}.ffn_{p}_exps.weight" for p in ("gate", "up", "down"))
        assert lay.expert_bytes[i] * 16 == sum(exps[n].n_bytes for n in lay.expert_names[i])
    assert lay.expert_bytes[0] < lay.expert_bytes[3]  # Q4_K_M: Q6_K ffn_down_exps in the last layers
    assert lay.card_fixed_bytes == sum(t.n_bytes for t in gf if t.name not in exps)
    assert set(lay.fixed_names) == set(gf.tensors) - set(exps)
    assert lay.total_bytes == sum(t.n_bytes for t in gf)
    assert hash(lay) == hash(dataclasses.replace(lay))


def test_layout_from_numbers_checks_its_input():
    lay = ExpertLayout.from_numbers(4, 8, [0, 10, 10, 12], 100)
    assert lay.moe_layers == (1, 2, 3) and lay.expert_names[0] == () and lay.expert_tensor_bytes == 8 * 32
    assert "blk.0.ffn_gate.weight" in lay.fixed_names and "blk.1.ffn_gate_inp.weight" in lay.fixed_names
    with pytest.raises(ConfigError, match="one entry per layer"):
        ExpertLayout.from_numbers(4, 8, [10, 10], 100)
    with pytest.raises(ConfigError, match="n_experts is 0"):
        ExpertLayout.from_numbers(2, 0, [10, 10], 100)


# --- every rule ----------------------------------------------------------------------------------


def test_card_and_cpu_moe(big):
    on = Card().place(big)
    assert on.dtype == np.bool_ and on.shape == (48, 128) and on.all()
    d = describe(on, big)
    assert d["card_experts"] == 48 * 128 and d["host_experts"] == 0 and d["host_bytes"] == 0
    assert d["card_bytes"] == FIXED + 48 * 128 * ONE_EXPERT
    on = CpuMoe().place(big)
    assert not on.any()
    d = describe(on, big)
    assert d["card_bytes"] == FIXED and d["host_bytes"] == 48 * 128 * ONE_EXPERT and d["host_layers"] == 48


def test_n_cpu_moe_and_last_cpu_moe(big):
    assert host_rows(NCpuMoe(36).place(big)) == list(range(36))
    assert host_rows(LastCpuMoe(4).place(big)) == [44, 45, 46, 47]
    assert NCpuMoe(0).place(big).all() and LastCpuMoe(0).place(big).all()
    assert not NCpuMoe(48).place(big).any() and not LastCpuMoe(48).place(big).any()
    for rule in ("n-cpu-moe=49", "last-cpu-moe=49"):
        with pytest.raises(ConfigError, match=r"48 MoE layers.*0 <= N <= 48"):
            parse_rule(rule).place(big)
        with pytest.raises(ConfigError, match="48 MoE layers"):
            parse_rule(rule, big)


def test_card_experts_gives_every_layer_slots(big):
    on = parse_rule("card-experts=32").place(big)
    assert (on.sum(axis=1) == 32).all() and on[:, :32].all()
    assert CardExperts(0).place(big).sum() == 0 and CardExperts(128).place(big).all()
    with pytest.raises(ConfigError, match=r"128 experts per layer.*0 <= N <= 128"):
        parse_rule("card-experts=129").place(big)


def test_layer_counts_skip_dense_layers():
    lay = ExpertLayout.from_numbers(5, 4, [0, 7, 7, 7, 0], 100)  # dense first and last blocks
    on = NCpuMoe(2).place(lay)
    assert host_rows(on) == [1, 2] and on[0].all() and on[4].all()
    assert host_rows(LastCpuMoe(1).place(lay)) == [3]
    assert host_rows(CpuMoe().place(lay)) == [1, 2, 3]
    with pytest.raises(ConfigError, match="3 MoE layers"):
        NCpuMoe(4).place(lay)


def test_every_rule_on_the_synthetic_file(synth):
    gf, lay = synth
    total = sum(t.n_bytes for t in gf)
    for text, host in [("card", []), ("cpu-moe", [0, 1, 2, 3]), ("n-cpu-moe=1", [0]), ("last-cpu-moe=2", [2, 3]),
                       ("override=exps=CPU", [0, 1, 2, 3]), (r"override=blk\.[13]\.ffn_.*_exps", [1, 3])]:
        on = parse_rule(text).place(lay)
        assert host_rows(on) == host and on[[i for i in range(4) if i not in host]].all(), text
        d = describe(on, lay)
        assert d["card_bytes"] + d["host_bytes"] == total
    # a budget one layer and 3 experts past the fixed part
    on = Budget(lay.card_fixed_bytes + 16 * lay.expert_bytes[0] + 3 * lay.expert_bytes[1]).place(lay)
    assert on[0].all() and list(on[1]) == [True] * 3 + [False] * 13 and not on[2:].any()


# --- budget --------------------------------------------------------------------------------------


def test_budget_edges(big):
    on = Budget(FIXED).place(big)
    assert not on.any()  # exactly the fixed part: every expert on the host
    on = Budget(FIXED + ONE_EXPERT).place(big)
    assert on.sum() == 1 and on[0, 0]
    assert Budget(FIXED + ONE_EXPERT - 1).place(big).sum() == 0
    on = Budget(FIXED + 200 * ONE_EXPERT).place(big)  # a full layer, then the first 72 of the next
    assert on[0].all() and on[1, :72].all() and not on[1, 72:].any() and not on[2:].any()
    assert Budget(FIXED + 48 * 128 * ONE_EXPERT).place(big).all()
    assert Budget(100 * GiB).place(big).all()
    with pytest.raises(ConfigError) as e:
        Budget(FIXED - 1).place(big)
    assert "1.21 GiB" in str(e.value) and "smaller" in str(e.value) and "at least" in str(e.value)


def test_budget_counts_the_reserve(big):
    on = Budget(FIXED + 256 * MiB + 10 * ONE_EXPERT).place(big, reserve_bytes=256 * MiB)
    assert on.sum() == 10
    with pytest.raises(ConfigError, match=r"reserve 512.00 MiB"):
        Budget(FIXED + 256 * MiB).place(big, reserve_bytes=512 * MiB)
    with pytest.raises(ConfigError, match="reserve_bytes"):
        Card().place(big, reserve_bytes=-1)


def test_budget_mixed_expert_sizes():
    lay = ExpertLayout.from_numbers(3, 4, [10, 20, 10], 0)
    assert list(Budget(4 * 10 + 2 * 20 + 19).place(lay).sum(axis=1)) == [4, 2, 0]  # stops at the first misfit


@pytest.mark.parametrize("text, n", [
    ("20GiB", 20 * GiB), ("1.5GiB", 3 * GiB // 2), ("1.5 gib", 3 * GiB // 2), ("24000MB", 24 * 10**9),
    ("512mib", 512 * MiB), ("64KiB", 65536), ("2kb", 2000), ("123B", 123), ("1GB", 10**9), ("0.5KB", 500),
    ("1TiB", 1 << 40), (".5MiB", MiB // 2), ("1.0000001B", 1),
])
def test_sizes(text, n):
    assert parse_size(text) == n
    rule = parse_rule(f"budget={text}")
    assert rule == Budget(n) == Budget(text) and parse_rule(str(rule)) == rule


def test_budget_canonical_strings():
    assert [str(Budget(n)) for n in (20 * GiB, 3 * GiB // 2, 24 * 10**9, 123, 1000)] == \
        ["budget=20GiB", "budget=1.5GiB", "budget=24GB", "budget=123B", "budget=1KB"]


# --- override ------------------------------------------------------------------------------------


def test_override_llama_cpp_patterns(big):
    assert parse_rule("override=exps=CPU") == parse_rule("override=exps") == Override("exps=cpu")
    assert not parse_rule("override=exps=CPU").place(big).any()
    on = parse_rule(r"override=blk\.(1[0-9]|2[0-3])\.ffn_.*_exps").place(big)
    assert host_rows(on) == list(range(10, 24))
    assert host_rows(parse_rule(r"override=blk\.(1[0-9]|2[0-3])\.ffn_.*_exps=CPU").place(big)) == list(range(10, 24))
    assert host_rows(Override(r"^blk\.4\.").place(ExpertLayout.from_numbers(6, 2, 5, 0, fixed_names=[]))) == [4]


def test_override_errors(big):
    with pytest.raises(ConfigError, match=r"move together.*blk\.3\.ffn_gate_exps\.weight.*and not.*ffn_down_exps"):
        parse_rule(r"override=blk\.3\.ffn_(gate|up)_exps").place(big)
    with pytest.raises(ConfigError, match=r"only routed-expert tensors can live on the host; blk\.3\.ffn_gate_inp"):
        parse_rule(r"override=blk\.3\.ffn_gate").place(big)
    with pytest.raises(ConfigError, match=r"only routed-expert tensors.*token_embd\.weight"):
        parse_rule("override=token_embd").place(big)
    with pytest.raises(ConfigError, match="matches no tensor"):
        parse_rule("override=ffn_.*_experts").place(big)
    with pytest.raises(ConfigError, match="bad regex"):
        parse_rule("override=blk.(1[0-9]")
    with pytest.raises(ConfigError, match="only target accepted is CPU"):
        parse_rule("override=exps=CUDA0")
    for text in ("override", "override=", "override==CPU"):
        with pytest.raises(ConfigError, match="needs a regex"):
            parse_rule(text)


def test_override_on_the_file_refuses_card_tensors(synth):
    _, lay = synth
    with pytest.raises(ConfigError, match=r"only routed-expert tensors.*attn_q\.weight"):
        parse_rule(r"override=blk\.1\.attn_q").place(lay)


# --- parsing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", [Card(), CpuMoe(), NCpuMoe(36), LastCpuMoe(4), CardExperts(32), Budget(20 * GiB),
                                  Override("exps")])
def test_canonical_strings_round_trip(rule):
    again = parse_rule(str(rule))
    assert again == rule and hash(again) == hash(rule) and type(again) is type(rule)
    assert parse_rule(f"  {rule}\n") == rule
    assert parse_rule(rule) is rule
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.x = 1


@pytest.mark.parametrize("text, message", [
    ("", "empty rule"), ("   ", "empty rule"), ("gpu", "unknown rule name 'gpu'"), ("Card", "unknown rule name"),
    ("n_cpu_moe=3", "unknown rule name"), ("card=1", "takes no argument"), ("cpu-moe=all", "takes no argument"),
    ("n-cpu-moe", "needs N"), ("n-cpu-moe=", "needs N"), ("n-cpu-moe=-1", ">= 0, got -1"),
    ("n-cpu-moe=1.5", "whole number"), ("last-cpu-moe=x", "whole number"), ("n-cpu-moe=+2", "whole number"),
    ("budget", "budget needs a size"), ("budget=20", "with a unit"), ("budget=20 GiBs", "with a unit"),
    ("budget=-1GiB", "with a unit"), ("budget=1e9B", "with a unit"), ("budget=0MiB", "more than 0 bytes"),
    ("budget=0.1B", "more than 0 bytes"), ("override=[", "bad regex"),
])
def test_bad_strings(text, message):
    with pytest.raises(ConfigError) as e:
        parse_rule(text)
    assert message in str(e.value)
    assert "accepted: card | cpu-moe | n-cpu-moe=N | last-cpu-moe=N | card-experts=N | budget=SIZE" in str(e.value)


def test_bad_objects():
    with pytest.raises(ConfigError, match="string or a rule object"):
        parse_rule(3)
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="whole number"):
            NCpuMoe(bad)
    with pytest.raises(ConfigError, match="> 0"):
        Budget(0)


# --- a model without routed experts ---------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_layout(tmp_path_factory) -> ExpertLayout:
    cfg = gemma3.Config(n_layers=3, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, ff=48, n_vocab=64,
                        context_length=64, rms_eps=1e-6, sliding_window=8, swa_layers=gemma3.swa_pattern_layers(3, 3),
                        rope_base=1e6, rope_base_swa=1e4)
    path = tmp_path_factory.mktemp("gemma") / "g.gguf"
    w = GGUFWriter(str(path), "gemma3")
    specs = gemma3.tensor_specs(cfg)
    for s in specs:
        if not s.optional:
            w.add_tensor(s.name, np.zeros(s.shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf = GGUFFile(path)
    lay = ExpertLayout.from_file(gf, specs)
    assert lay.card_fixed_bytes == sum(t.n_bytes for t in gf)
    return lay


@pytest.mark.parametrize("text", ["card", "cpu-moe", "n-cpu-moe=0", "n-cpu-moe=5", "last-cpu-moe=2", "budget=1GiB",
                                  "override=exps"])
def test_no_experts_every_rule_is_all_card(gemma_layout, text):
    assert gemma_layout.shape == (3, 0) and not gemma_layout.has_experts
    on = parse_rule(text).place(gemma_layout)
    assert on.shape == (3, 0) and on.all()
    d = describe(on, gemma_layout)
    assert d["card_experts"] == d["host_experts"] == d["host_bytes"] == 0
    assert d["card_bytes"] == gemma_layout.card_fixed_bytes


def test_no_experts_still_refuses_impossible_rules(gemma_layout):
    with pytest.raises(ConfigError, match="smaller than what must stay on the card"):
        Budget(100).place(gemma_layout)
    with pytest.raises(ConfigError, match=r"only routed-expert tensors.*ffn_up"):
        parse_rule("override=ffn_up").place(gemma_layout)


# --- gin and the registry ------------------------------------------------------------------------


def test_gin_selects_a_rule():
    st = load_settings(bindings=["RuntimeSettings.placement = 'n-cpu-moe=36'"])
    assert parse_rule(st.placement) == NCpuMoe(36)
    st = load_settings(bindings=["RuntimeSettings.placement = @placement.NCpuMoe()", "placement.NCpuMoe.n = 36"])
    assert type(st.placement) is NCpuMoe and parse_rule(st.placement) == NCpuMoe(36)
    st = load_settings(bindings=["RuntimeSettings.placement = @Budget()", "Budget.bytes = '1.5GiB'"])
    assert st.placement == Budget(3 * GiB // 2)
    assert NCpuMoe() == NCpuMoe(0)  # bindings do not outlive load_settings


def test_research_rules_register():
    @dataclasses.dataclass(frozen=True)
    class EvenOnHost(PlacementRule):
        name: ClassVar[str] = "test-even-on-host"
        form: ClassVar[str] = "test-even-on-host"

        def decide(self, layout, reserve_bytes):
            on = all_card(layout)
            on[list(layout.moe_layers), ::2] = False
            return on

    assert register_rule(EvenOnHost) is EvenOnHost and register_rule(EvenOnHost) is EvenOnHost
    try:
        on = parse_rule("test-even-on-host").place(ExpertLayout.from_numbers(2, 4, 1, 0))
        assert on.tolist() == [[False, True, False, True]] * 2
        with pytest.raises(ConfigError, match="is taken"):
            register_rule(type("Other", (EvenOnHost,), {}))
    finally:
        del RULES["test-even-on-host"]
    assert list(RULES) == ["card", "cpu-moe", "n-cpu-moe", "last-cpu-moe", "card-experts", "budget", "override"]


def test_bad_rule_output_is_caught():
    @dataclasses.dataclass(frozen=True)
    class Broken(PlacementRule):
        name: ClassVar[str] = "broken"

        def decide(self, layout, reserve_bytes):
            return np.zeros(layout.shape, dtype=bool)

    with pytest.raises(ValueError, match="layers without routed experts"):
        Broken().place(ExpertLayout.from_numbers(2, 4, [0, 5], 0))
    wrong = type("Wrong", (Broken,), {"decide": lambda self, layout, reserve_bytes: np.ones((1, 1))})
    with pytest.raises(ValueError, match="want bool"):
        wrong().place(ExpertLayout.from_numbers(2, 4, 5, 0))
