"""python -m bloomery_jax.bench records and the source witness.

Shapes follow test_generate.py (ubatch 16, 2 cache rows, 64 positions), so the compiled steps
are shared within a session.
"""

from __future__ import annotations

import io
import json
import subprocess

import pytest

from bloomery_jax import bench, witness

SHAPE = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8, n_experts_used=2,
             expert_ff=64, n_vocab=512)
COMMON = ["--ubatch", "16", "--no-compile-cache", "--quiet"]


@pytest.fixture(scope="module")
def model_path(synth_model):
    return str(synth_model(seed=3, **SHAPE)[0])


def test_records_for_each_parallel_count(model_path):
    out = io.StringIO()
    # -p 16 -n 47: 16 + 47 + 1 = 64 positions, the cache of test_generate.py
    recs = bench.run(["--model", model_path, "-p", "16", "-n", "47", "--parallel", "1,2", "--reps", "2", "--json",
                      *COMMON], out=out, err=io.StringIO())
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines == json.loads(json.dumps(recs))
    assert [(r["test"], r["parallel"]) for r in recs] == [("pp16", 1), ("tg47", 1), ("pp16", 2), ("tg47", 2)]
    for r in recs:
        assert len(r["samples"]) == 2 and r["tps_min"] <= r["tps_median"] <= r["tps_max"]
        assert r["tps_min"] > 0 and r["depth"] == 0 and r["reps"] == 2
        w = r["witness"]
        assert set(w) >= {"commit", "dirty_tracked", "packages", "device"}
        assert w["packages"]["jax"] and w["device"]["platform"] == "cpu"


def test_decode_block_record(model_path):
    """-n 11 in blocks of 4: two blocks and three single steps, recorded with the block size."""
    recs = bench.run(["--model", model_path, "-p", "8", "-n", "11", "--reps", "1", "--decode-block", "4", "--json",
                      *COMMON], out=io.StringIO(), err=io.StringIO())
    assert [(r["test"], r["decode_block"]) for r in recs] == [("pp8", 4), ("tg11", 4)] and recs[1]["tps_min"] > 0


def test_host_share_of_the_timed_decodes(model_path):
    """With host experts, the tg record says how many host calls a timed decode made, what one
    took and what share of the decode's time the host kernels were: the timed decodes alone, not
    the warm-up and prefill steps the run's totals count."""
    recs = bench.run(["--model", model_path, "-p", "8", "-n", "6", "--reps", "2", "--json", "--place", "card-experts=2",
                      *COMMON], out=io.StringIO(), err=io.StringIO())
    stats = recs[-1]["placement"]
    n_layers = SHAPE["n_layers"]
    assert 0 < stats["decode_host_calls"] <= 6 * n_layers < stats["host_calls"]
    assert 0 < stats["decode_host_share"] <= 1 and stats["decode_host_ms_per_call"] > 0
    assert stats["decode_host_ms_per_call"] * 1e-3 * stats["decode_host_calls"] < stats["host_kernel_s"]
    split = stats["decode_host_us_per_call_split"]  # medians of each part: their sum is near a call's time
    assert set(split) == {"serial", "wake", "work", "join"} and min(split.values()) >= 0 and split["work"] > 0
    assert sum(split.values()) < 1.5e3 * stats["decode_host_ms_per_call"]


def test_depth_and_table(model_path):
    out = io.StringIO()
    recs = bench.run(["--model", model_path, "-p", "13", "-n", "40", "--depth", "10", "--reps", "1", *COMMON],
                     out=out, err=io.StringIO())
    assert [r["test"] for r in recs] == ["pp13", "tg40"] and all(r["depth"] == 10 for r in recs)
    text = out.getvalue().splitlines()
    assert text[0].startswith("| model |") and len(text) == 2 + len(recs) + 1
    assert "| 1 | 10 | pp13 |" in text[2] and text[-1].startswith("commit ")


@pytest.mark.parametrize("argv, message", [
    (["-p", "0", "-n", "0"], "nothing to measure"),
    (["--parallel", "1,x"], "comma-separated"),
    (["--reps", "0"], "--reps"),
    (["--depth", "-1"], "--depth"),
    (["--decode-block", "-1"], "--decode-block"),
])
def test_errors_are_one_line(argv, message, model_path, capsys):
    assert bench.main(["--model", model_path, *argv, *COMMON]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err


def test_witness_in_a_checkout_counts_dirty_files(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    (tmp_path / "b.txt").write_text("1")
    git("add", "a.txt", "b.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    commit, dirty = witness.git_state(tmp_path)
    assert len(commit) == 40 and dirty == 0
    (tmp_path / "a.txt").write_text("2")
    (tmp_path / "untracked.txt").write_text("not counted")
    assert witness.git_state(tmp_path) == (commit, 1)


def test_witness_unknown_is_none_never_zero(tmp_path, monkeypatch):
    assert witness.git_state(tmp_path) == (None, None)  # not a checkout
    subprocess.run(["git", "-C", str(tmp_path), "init", "-q"], check=True)
    (tmp_path / "a.txt").write_text("1")
    # a repository without a commit (as a copied tree may be): the dirty count is unknown too
    assert witness.git_state(tmp_path) == (None, None)
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    w = witness.source_witness()
    assert w["commit"] is None and w["dirty_tracked"] is None
    line = witness.describe(w)
    assert "commit unknown (unknown dirty state)" in line and " 0 dirty" not in line


def test_source_digest_names_the_code_without_git(tmp_path):
    """The files on disk give the digest that the commit holding them gives through git, so a
    record from a copied tree (whose .git is another commit's) still names its code; compiled
    copies do not count, a changed byte does."""
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.cc").write_text("int b;\n")
    git("init", "-q")
    git("add", "pkg")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    digest = witness.source_digest(pkg)
    assert len(digest) == 16 and witness.commit_digest("HEAD", tmp_path, "pkg") == digest
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\0compiled")
    assert witness.source_digest(pkg) == digest
    (pkg / "a.py").write_text("x = 2\n")
    assert witness.source_digest(pkg) != digest
    assert witness.commit_digest("no-such-commit", tmp_path, "pkg") is None
    assert witness.source_witness()["source_digest"] == witness.source_digest()
