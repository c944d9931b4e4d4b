"""The GPU machine's measurements in a few planned calls: each stage writes JSON under --out.

Stages (each fits one device call of <= 10 minutes; run them back to back while the machine is
warm, so /tmp/bloomery keeps the synthesized model between them):

  oracle     HERE, on the CPU with llama-cpp-python: synthetic qwen3moe files (F32, and the F32
             twin of a Q4_K_M file; three shapes) and llama.cpp's logits over 500 tokens, into
             .baseline/oracle/ (git-ignored; carry it). The files themselves are rebuilt there
             from their seeds (checked by SHA-256): they are too large to carry.
  precision  THERE: our logits on the GPU under jax.default_matmul_precision("highest") against
             those llama.cpp logits: max |dlogit| / std at positions before a router near-tie
             (the CPU test's bound is 1e-3).
  model      THERE: the Qwen3-30B-A3B-shaped Q4_K_M file (48 layers, 128 experts top-8, hidden
             2048, expert ff 768, 32/4 heads of 128, vocab 151936; routing skewed) in /tmp/bloomery.
  bench      THERE: our bench (pp512, tg128; parallel 1 and 2) with every expert on the card,
             with the experts of 36 layers on the host (n-cpu-moe=36), and with 32 of 128 experts
             per layer on the card without residency, with LFU swaps, and with prompt streaming.
  host       THERE: host-expert kernel GB/s against the host's read bandwidth, and the bridge's
             per-call overhead (scripts/host_bench.py, scripts/bridge_bench.py).
  compare    ratios of our bench records to llama-bench's in --out (compare.json).
  llamacpp   THERE: llama-bench on the same file, all layers on the card and -ncmoe 36
             (needs `bash ../shared/tools/llamacpp_gpu.sh prepare` here first, then .baseline/
             carried; the build takes ~4-8 minutes, so run `build` as its own call).

Example device calls (see scripts/device_wheels.sh for the wheels):

    P='python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
       && export PYTHONPATH=/tmp/site:$PWD'
    run: "$P; python3 scripts/gpu_session.py precision model bench --out $OUT"   carry .whl .baseline

`--tiny` shrinks every model so the whole flow can be checked on a CPU first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ORACLE = ROOT / ".baseline" / "oracle"
WORK = Path(os.environ.get("BLOOMERY_WORK", "/tmp/bloomery"))

ORACLE_SHAPES = {  # the shapes of tests/test_llamacpp_qwen3moe.py
    "gqa": dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8,
                n_experts_used=2, expert_ff=256, n_vocab=512),
    "mqa": dict(n_layers=3, d_model=256, n_heads=8, n_kv_heads=1, head_dim=32, n_experts=16,
                n_experts_used=4, expert_ff=256, n_vocab=384),
    "mha": dict(n_layers=2, d_model=256, n_heads=2, n_kv_heads=2, head_dim=128, n_experts=4,
                n_experts_used=1, expert_ff=256, n_vocab=320),
}
N_TOKENS, NEAR_TIE = 500, 1e-4
QWEN30B = dict(n_layers=48, d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128, n_experts=128,
               n_experts_used=8, expert_ff=768, n_vocab=151936)
TINY = dict(n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=16, n_experts_used=4,
            expert_ff=256, n_vocab=1024)


def log(msg: str) -> None:
    print(f"[gpu_session {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_json(out: Path, name: str, data) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(data, indent=1, default=str))
    print(json.dumps({name: data}, default=str)[:4000], flush=True)


# --- precision (issue 3) ---------------------------------------------------------------------

def oracle_file(name: str, kind: str, directory: Path) -> Path:
    """Write the oracle model ``name``-``kind`` (f32 or twin) into ``directory``; the same bytes
    every time (every value is a function of the seed), so only its logits need to travel."""
    from bloomery_jax.synth import synthesize

    path = directory / f"{name}-{kind}.gguf"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        shape = ORACLE_SHAPES[name]
        if kind == "f32":
            synthesize(path, qtype="F32", seed=1, **shape)
        else:
            synthesize(directory / f"{name}-q4km.gguf", qtype="Q4_K_M", seed=2, twin_path=path, **shape)
            (directory / f"{name}-q4km.gguf").unlink()
    return path


def sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def stage_oracle(args) -> None:
    import llama_cpp

    ORACLE.mkdir(parents=True, exist_ok=True)
    for name, shape in ORACLE_SHAPES.items():
        for kind in ("f32", "twin"):
            path = oracle_file(name, kind, WORK / "oracle")
            tokens = np.random.default_rng(7).integers(0, shape["n_vocab"], N_TOKENS).astype(np.int32)
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, n_threads=2, verbose=False,
                                  type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
            llm.eval(tokens.tolist())
            logits = np.array(llm.scores[:N_TOKENS], np.float32)
            np.savez_compressed(ORACLE / f"{name}-{kind}.llama.npz", tokens=tokens, logits=logits,
                                sha256=sha256(path))
            log(f"oracle {path.name}: {logits.shape}")


def stage_precision(args) -> None:
    import jax

    from bloomery_jax.eval.runner import sequence_logits
    from bloomery_jax.models import qwen3moe
    from bloomery_jax.models.loader import load_model

    results = []
    for ref_file in sorted(ORACLE.glob("*.llama.npz")):
        name, kind = ref_file.name.removesuffix(".llama.npz").rsplit("-", 1)
        path = oracle_file(name, kind, WORK / "oracle")
        ref = np.load(ref_file)
        if str(ref["sha256"]) != sha256(path):
            raise SystemExit(f"{path} differs from the file llama.cpp ran (numpy or synth changed)")
        tokens, theirs = ref["tokens"], ref["logits"]
        model = load_model(path)
        with jax.default_matmul_precision("highest"):
            ours = sequence_logits(model, tokens, ubatch=512)
            cache = model.init_cache(1, len(tokens))
            _, _, routing = qwen3moe.jit_forward(model.params, model.cfg, tokens[None],
                                                 np.arange(len(tokens))[None], cache)
        ties = (np.asarray(routing.margin[:, 0]) < NEAR_TIE).any(axis=0)
        first = int(np.argmax(ties)) if ties.any() else len(tokens)
        keep = slice(0, first)
        rel = float(np.abs(ours - theirs)[keep].max() / theirs[keep].std())
        results.append(dict(model=path.name, positions=len(tokens), compared=first, max_rel_dlogit=rel,
                            bound=1e-3, ok=rel <= 1e-3, device=str(jax.devices()[0].device_kind)))
        log(f"precision {path.name}: max |dlogit|/std {rel:.3g} over {first} positions")
    write_json(args.out, "precision.json", results)


# --- the big model and our bench (issues 5, 7, 8, 9) -----------------------------------------

def model_shape(args) -> dict:
    shape = dict(TINY if args.tiny else QWEN30B)
    if args.layers:
        shape["n_layers"] = args.layers
    return shape


def model_path(args) -> Path:
    layers = f"-{args.layers}l" if args.layers else ""
    return WORK / (f"tiny{layers}-q4km.gguf" if args.tiny else f"qwen3-30b-a3b-shape{layers}-q4km.gguf")


def stage_model(args) -> None:
    from bloomery_jax.synth import synthesize

    path = model_path(args)
    if path.exists():
        log(f"model {path} already there")
        return
    WORK.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = synthesize(path, qtype="Q4_K_M", seed=0, route_skew=2.0, **model_shape(args))
    write_json(args.out, "model.json", dict(path=str(path), bytes=path.stat().st_size,
                                            seconds=time.perf_counter() - t0, report=str(report)))


def bench(args, name: str, extra: list[str], parallel: str = "1,2") -> None:
    """One `python -m bloomery_jax.bench` run; its JSON records go to <name>.json."""
    p, n = ("64", "16") if args.tiny else ("512", "128")
    cmd = [sys.executable, "-m", "bloomery_jax.bench", "--model", str(model_path(args)), "-p", p, "-n", n,
           "--parallel", parallel, "--reps", str(args.reps), "--json", "--kernels", args.kernels,
           "--attention", args.attention, "--bridge", args.bridge, "--routing", args.routing,
           "--decode-block", str(args.decode_block), *extra]
    log(" ".join(cmd))
    t0 = time.perf_counter()
    try:
        env = dict(os.environ, **({"BLOOMERY_FFI_SIGNAL": args.signal} if args.signal else {}),
                   **({"BLOOMERY_HOST_PAGES": args.pages} if args.pages else {}))
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=args.variant_timeout, env=env)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:  # keep what it printed: load and compile times
        rc, stdout, stderr = "timeout", _text(e.stdout), _text(e.stderr)
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    tag = (args.kernels + ("" if args.attention == "xla" else f"-attn-{args.attention}")
           + ("" if args.routing == "xla" else f"-route-{args.routing}")
           + ("" if args.bridge == "callback" else f"-bridge-{args.bridge}")
           + (f"-{args.signal}" if args.signal else "")
           + (f"-pages-{args.pages}" if args.pages else "")
           + ("" if args.decode_block == 1 else f"-block{args.decode_block}"))
    write_json(args.out, f"bench-{name}-{tag}.json", dict(command=" ".join(cmd), rc=rc, records=records,
                                                    stderr=stderr[-3000:], seconds=time.perf_counter() - t0))


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def bench_variants(args) -> dict[str, tuple[list[str], str]]:
    """name -> (bench options, parallel counts)."""
    quarter = ["--place", f"card-experts={model_shape(args)['n_experts'] // 4}"]
    return {
        "card": (["--place", "card"], "1,2"),
        "ncmoe36": (["--place", "n-cpu-moe=3" if args.tiny else "n-cpu-moe=36"], "1"),
        "quarter-static": (quarter, "1"),
        "quarter-lfu": (quarter + ["--residency", "lfu", "--no-prompt-streaming"], "1"),
        "quarter-lfu-stream": (quarter + ["--residency", "lfu"], "1"),
    }


def stage_bench(args) -> None:
    # Each variant compiles its own steps (minutes for 48 layers): split them over calls with
    # --only; the persistent compilation cache keeps what a warm machine compiled before.
    for name, (extra, parallel) in bench_variants(args).items():
        if not args.only or name in args.only:
            bench(args, name, extra, args.parallel or parallel)


def stage_host(args) -> None:
    # the decode question: one and eight tokens at the thread count the bridge uses (cores - 2),
    # under each work-item layout (rows per item : software prefetch bytes ahead)
    threads = str(max(1, (os.cpu_count() or 3) - 2))
    host = ["--weights", "q4_k_m", "--acts", "q8", "--tokens", "1,8", "--threads", threads,
            "--layouts", os.environ.get("HOST_LAYOUTS", "0:1260,0:2304,0:4608,0:9216"),
            "--memory", os.environ.get("HOST_MEMORY", "numpy,huge")]
    if args.tiny:
        host += ["--reps", "3", "--d", "256", "--f", "256", "--experts", "16"]
    args.out.mkdir(parents=True, exist_ok=True)
    for script, extra, flag in (("host_bench.py", host, "--out"),
                                ("bridge_bench.py", ["--layers", "48", "--reps", "20", "--bridges", "callback,ffi,ffi-doorbell"], "--json")):
        cmd = [sys.executable, str(ROOT / "scripts" / script), *extra, flag, str(args.out / f"{script[:-3]}.json")]
        log(" ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        print(proc.stdout[-3000:], proc.stderr[-1500:], flush=True)


def stage_llamacpp(args) -> None:
    binary = ROOT / ".baseline" / "build" / "bin" / "llama-bench"
    if not binary.exists():
        raise SystemExit("llama-bench is not built: run `bash .baseline/llamacpp_gpu.sh build` first")
    results = {}
    runs = (("all-card", "card", []), ("ncmoe36", "ncmoe36", ["-ncmoe", "36"]))
    for name, ours, extra in runs:
        if args.only and not any(v == ours or (v.startswith("quarter") and ours == "ncmoe36") for v in args.only):
            continue  # --only names our variants: llama.cpp runs the setting compare pairs each with
        cmd = [str(binary), "-m", str(model_path(args)), "-p", "512", "-n", "128", "-ngl", "99", "-fa", "1",
               "-t", str(os.cpu_count()), "-r", str(args.reps), "-o", "json", *extra]
        log(" ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        results[name] = dict(command=" ".join(cmd), rc=proc.returncode,
                             records=json.loads(proc.stdout) if proc.returncode == 0 else proc.stderr[-2000:])
    write_json(args.out, "llamacpp.json", results)


def stage_compare(args) -> None:
    """HERE or THERE: ratios of our bench to llama-bench from the JSON in --out, median tok/s on
    both sides (llama-bench reports a mean, which its slow first repetition pulls down: the
    seventeenth session's pp512 had 5,514, 7,011 and 7,182)."""
    ours, splits = {}, {}
    for path in sorted(args.out.glob("bench-*.json")):
        for r in json.loads(path.read_text())["records"]:
            ours[(path.stem, r["test"], r["parallel"])] = r["tps_median"]
            placed = r.get("placement", {})
            if "decode_host_us_per_call_split" in placed:  # where a decode's host call went (tg records)
                splits[path.stem] = (placed["decode_host_ms_per_call"], placed["decode_host_us_per_call_split"])
    theirs = {}
    for name, run in json.loads((args.out / "llamacpp.json").read_text()).items():
        for r in run["records"] if isinstance(run["records"], list) else []:
            theirs[(name, f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}")] = statistics.median(r.get("samples_ts") or [r["avg_ts"]])
    # llama.cpp's counterpart of each of our variants: -ncmoe 36 keeps 12 of 48 layers' experts on
    # the card, the card memory of a quarter of every layer's experts (the quarter-* variants)
    variants = sorted(bench_variants(args), key=len, reverse=True)  # "quarter-lfu-stream" before "quarter-lfu"
    pairs = {}
    for stem, _, _ in ours:
        name = next((v for v in variants if stem.startswith(f"bench-{v}-")), None)
        if name:
            pairs[stem] = "all-card" if name == "card" else "ncmoe36"
    rows = [dict(ours=stem, llamacpp=pairs[stem], test=test, parallel=par, ours_tps=round(tps, 1),
                 llamacpp_tps=round(theirs[(pairs[stem], test)], 1), ratio=round(tps / theirs[(pairs[stem], test)], 3))
            for (stem, test, par), tps in ours.items() if stem in pairs and (pairs[stem], test) in theirs]
    for r in rows:
        print(f"{r['ours']:22s} p{r['parallel']} {r['test']:6s} ours {r['ours_tps']:8.1f}  "
              f"llama.cpp {r['llamacpp_tps']:8.1f}  ratio {r['ratio']:.3f}")
    for stem, (ms, split) in splits.items():
        print(f"{stem}: a decode host call {ms * 1e3:.1f} us: " + ", ".join(f"{k} {v}" for k, v in split.items()))
    write_json(args.out, "compare.json", rows)


STAGES = {"oracle": stage_oracle, "precision": stage_precision, "model": stage_model, "bench": stage_bench,
          "host": stage_host, "llamacpp": stage_llamacpp,
          "compare": stage_compare}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("stages", nargs="+", choices=list(STAGES))
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_out")))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variant-timeout", type=float, default=None, help="seconds one bench variant may run")
    p.add_argument("--layers", type=int, default=None, help="the big model with this many layers (default 48)")
    p.add_argument("--kernels", default="auto", help="bench --kernels (reference | pallas | pallas-tf32 | pallas-qtiles | pallas-bf16 | pallas-q8 | auto)")
    p.add_argument("--attention", default="xla", choices=("xla", "pallas"), help="bench --attention (default xla)")
    p.add_argument("--routing", default="xla", choices=("xla", "pallas", "pallas-tickets"), help="bench --routing (default xla)")
    p.add_argument("--bridge", default="callback", choices=("callback", "ffi"), help="bench --bridge (default callback)")
    p.add_argument("--signal", default=None, choices=("hostfunc", "doorbell"),
                   help="the FFI bridge's signal for bench (BLOOMERY_FFI_SIGNAL; default: bench's own)")
    p.add_argument("--pages", default=None, choices=("small", "huge"),
                   help="the host experts' memory pages for bench (BLOOMERY_HOST_PAGES; default: bench's own)")
    p.add_argument("--decode-block", type=int, default=1, help="bench --decode-block (default 1)")
    p.add_argument("--parallel", default=None, help="bench --parallel for every variant (default: its own)")
    p.add_argument("--tiny", action="store_true", help="small models: check the flow on a CPU")
    p.add_argument("--only", type=lambda v: v.split(","), default=None,
                   help="bench variants to run, comma-separated: card, ncmoe36, quarter-static, quarter-lfu, "
                        "quarter-lfu-stream (default all)")
    args = p.parse_args(argv)
    from bloomery_jax.witness import source_witness

    write_json(args.out, "witness.json", source_witness())
    for stage in args.stages:
        t0 = time.perf_counter()
        STAGES[stage](args)
        log(f"stage {stage} done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
