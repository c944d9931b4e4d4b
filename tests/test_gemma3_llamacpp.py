"""The real Gemma 3 270M (Q4_K_M: F32, Q5_0, Q4_K, Q8_0, Q6_K) against llama.cpp.

Tokens come from llama.cpp's own tokenizer, so these tests do not depend on ours. Our side runs
the exact path: the file's dequantized values, float32 activations.

* Logits on a 551-token English prompt (it crosses the 512-token sliding window): llama.cpp's
  CPU backend rounds activations to 8 bits before every quantized matmul, so we compare by KL
  divergence and top-1 agreement, with the window region checked on its own.
* Greedy continuations (32 tokens, prefill then one token at a time over our KV cache) for six
  prompts. A divergence is accepted only at a certified near-tie: where the two engines'
  gaps between the two tokens differ by no more than llama.cpp's measured rounding noise.
* The same against llama.cpp on an F32 twin of the file (the dequantized values written as
  F32, so llama.cpp rounds nothing): logits agree to float32 noise and every greedy
  continuation is identical. This is what shows the quantized-file gaps are llama.cpp's
  activation rounding and not our bug.

The greedy continuations on the quantized file run in the default suite (about a minute); the
long-prompt logits and the twin are slow (llama.cpp computes 262144 logits for each of 551
positions on the CPU; the twin is a 1 GiB file).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from bloomery_jax.default_model import default_model_path
from bloomery_jax.gguf_file import GGUFFile
from bloomery_jax.models.loader import load_model
from bloomery_jax.quant import dequantize

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llamacpp

N_NEW = 32
PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
]
LONG_TEXT = """The river town of Elmsford grew up where an old Roman road crossed the water at a shallow ford. For centuries it was little more than a cluster of farms, a mill and a small stone church, but in the late twelfth century the local lord obtained a market charter from the king, and the town began to change. Every Thursday, farmers from the surrounding valleys brought wool, grain, cheese and livestock to the market square, while merchants from the coast arrived with salt, dried fish and cloth dyed in colours that few villagers had ever seen.

The wool trade made Elmsford rich. By the fourteenth century its merchants were selling fleeces to weavers in Flanders and Italy, and the profits paid for a new bridge, a guildhall and the tall tower of the parish church, which can still be seen for miles across the flat meadows. The Black Death struck the town in 1349 and killed perhaps a third of its people, yet the survivors found that labour had become scarce and valuable, and many of them moved into the town from the countryside in search of better wages.

In the sixteenth and seventeenth centuries the town's fortunes rose and fell with the price of cloth. A fire in 1666 destroyed most of the timber houses around the square, and the council ordered that new buildings be made of brick or stone. The result is the handsome row of merchants' houses that visitors admire today, with their tall windows, carved doorways and steep tiled roofs.

The arrival of the canal in 1790 and the railway in 1846 connected Elmsford to the growing industrial cities of the north. Factories making shoes, bricks and agricultural machinery were built along the river, and the population doubled within fifty years. Rows of terraced houses spread across the fields to the east of the old town, and new schools, chapels and a public library were opened to serve the workers and their families.

During the twentieth century most of those factories closed. The canal fell into disuse, and for a time the town seemed to have lost its purpose. Since the 1980s, however, Elmsford has found new life as a centre for tourism, small technology companies and the arts. The old warehouses along the river have become studios, restaurants and apartments, and the restored canal is popular with walkers, cyclists and people on narrow boats. Each summer the town holds a festival of music and literature that attracts visitors from across the country.

Historians who study the town often point out that its story reflects the wider history of the region: periods of growth and confidence, followed by disaster, recovery and reinvention. The people of Elmsford have always adapted to changing times, and the"""
WINDOW = 512
N_CTX = 640

# llama.cpp's activation-rounding noise on this model, in logit units: on the long prompt, the
# gap between llama.cpp's top-1 and each of its next four tokens differs between the engines
# by 0.12 on average, 0.48 at the 99th percentile, 0.86 at most. Against the F32 twin the
# same gaps agree to within 0.03 (max |Δlogit| measured 0.0225).
QUANT_NOISE = 0.5
TWIN_NOISE = 0.05


def open_llama(path, n_ctx: int):
    # F32 KV cache: llama.cpp's default F16 cache would add its own rounding.
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, type_k=0, type_v=0,
                           n_threads=2, verbose=False)


@pytest.fixture(scope="module")
def gemma_path():
    return default_model_path()


@pytest.fixture(scope="module")
def ours(gemma_path):
    """(model, params): params dequantized once, so decode steps do not redo it per token."""
    import jax

    m = load_model(gemma_path)
    params = jax.jit(lambda ps: {k: v.dequantize() for k, v in ps.items()})(m.params)
    return m, params


@pytest.fixture(scope="module")
def prompts(gemma_path):
    llm = llama_cpp.Llama(model_path=str(gemma_path), vocab_only=True, verbose=False)
    tok = lambda s: llm.tokenize(s.encode(), add_bos=True, special=False)  # noqa: E731
    return tok(LONG_TEXT), [tok(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def twin_path(gemma_path, tmp_path_factory):
    return write_f32_twin(gemma_path, tmp_path_factory.mktemp("twin") / "gemma3-270m-f32.gguf")


def write_f32_twin(src, dst) -> str:
    """The same model with every tensor dequantized to F32 (metadata copied key by key)."""
    reader = GGUFReader(str(src))
    w = GGUFWriter(str(dst), "gemma3")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        if vtype == GGUFValueType.ARRAY:
            sub = field.types[1]
            if sub == GGUFValueType.STRING:
                value = [bytes(field.parts[i]).decode("utf-8", errors="surrogateescape") for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(name, value, vtype, sub_type=sub)
        elif vtype == GGUFValueType.STRING:
            w.add_key_value(name, bytes(field.parts[field.data[0]]).decode("utf-8"), vtype)
        else:
            w.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)
    w.add_file_type(0)  # ALL_F32
    for info in GGUFFile(src):
        w.add_tensor(info.name, np.asarray(dequantize(info.data, info.qtype, info.shape), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(dst)


# --- helpers ------------------------------------------------------------------------------------

def kl_per_position(ref: np.ndarray, ours: np.ndarray, chunk: int = 64) -> np.ndarray:
    """KL(llama.cpp || ours) at every position, in float64, a chunk of rows at a time."""
    out = []
    for i in range(0, len(ref), chunk):
        p, q = ref[i:i + chunk].astype(np.float64), ours[i:i + chunk].astype(np.float64)
        lp = p - p.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        lq = q - q.max(-1, keepdims=True)
        lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
        out.append((np.exp(lp) * (lp - lq)).sum(-1))
    return np.concatenate(out)


def our_logits(ours, tokens) -> np.ndarray:
    m, params = ours
    T = len(tokens)
    logits, _, routing = m.module.jit_forward(params, m.cfg, np.asarray([tokens], np.int32),
                                              np.arange(T, dtype=np.int32)[None], m.init_cache(1, N_CTX))
    assert routing is None
    return np.asarray(logits[0])


def llama_logits(path, tokens) -> np.ndarray:
    llm = open_llama(path, N_CTX)
    llm.eval(tokens)
    return np.array(llm.scores[:len(tokens)], np.float32)


def our_greedy(ours, prompts: list[list[int]], n_new: int) -> np.ndarray:
    """Greedy continuations of all prompts at once: one prefill, then one token per step.

    Prompts are right-padded; padding sits at position S (beyond the cache), so it is never
    stored and no real token attends to it. Returns int ``[B, n_new]``.
    """
    m, params = ours
    f = m.module.jit_forward
    B, lens = len(prompts), np.array([len(p) for p in prompts], np.int32)
    S = int(lens.max()) + n_new
    toks = np.zeros((B, lens.max()), np.int32)
    pos = np.full((B, lens.max()), S, np.int32)
    for b, p in enumerate(prompts):
        toks[b, :len(p)], pos[b, :len(p)] = p, np.arange(len(p))
    logits, cache, _ = f(params, m.cfg, toks, pos, m.init_cache(B, S))
    nxt = np.asarray(logits)[np.arange(B), lens - 1].argmax(-1).astype(np.int32)  # [B]
    out = [nxt]
    for i in range(n_new - 1):
        logits, cache, _ = f(params, m.cfg, nxt[:, None], (lens + i)[:, None], cache)
        nxt = np.asarray(logits[:, 0]).argmax(-1).astype(np.int32)
        out.append(nxt)
    return np.stack(out, axis=1)


def llama_greedy(path, prompts, n_new: int):
    """llama.cpp's greedy continuation of each prompt, with its logits at every step."""
    llm = open_llama(path, 128)
    runs = []
    for p in prompts:
        llm.reset()
        llm.eval(p)
        toks, rows = [], []
        for _ in range(n_new):
            row = np.array(llm.scores[llm.n_tokens - 1], np.float32)
            toks.append(int(row.argmax()))
            rows.append(row)
            llm.eval([toks[-1]])
        runs.append((np.array(toks), np.stack(rows)))
    return runs


def check_greedy(ours_toks: np.ndarray, runs, ours, prompts, noise: float) -> list[int]:
    """Each continuation equals llama.cpp's up to a certified near-tie; returns divergence steps.

    At the first differing step, with llama.cpp's token a and ours b, the two engines' gaps
    ``logit[a] - logit[b]`` must differ by at most ``noise``, and llama.cpp's own preference
    for a must be below ``noise``: one engine's rounding decides, not the model.
    """
    m, params = ours
    diverged = []
    for b, (ref_toks, ref_rows) in enumerate(runs):
        same = ref_toks == ours_toks[b]
        if same.all():
            continue
        j = int(np.argmin(same))
        a, c = int(ref_toks[j]), int(ours_toks[b, j])
        # our logits at that step, on the shared prefix (prompt + the agreed j tokens)
        row = our_logits(ours, list(prompts[b]) + ref_toks[:j].tolist())[-1]
        ref_gap, our_gap = ref_rows[j][a] - ref_rows[j][c], row[a] - row[c]
        assert ref_gap >= 0 and our_gap <= 0
        assert ref_gap - our_gap <= noise, (
            f"prompt {b} diverges at step {j}: llama.cpp prefers {a} by {ref_gap:.3f}, we prefer {c} by "
            f"{-our_gap:.3f}; the gaps differ by more than the noise {noise}")
        diverged.append(j)
    return diverged


# --- the quantized file ---------------------------------------------------------------------------

@pytest.mark.slow
def test_long_prompt_logits(gemma_path, ours, prompts):
    tokens, _ = prompts
    T = len(tokens)
    assert WINDOW < T <= N_CTX  # the last positions attend through the window in 15 of 18 layers
    ref = llama_logits(gemma_path, tokens)
    got = our_logits(ours, tokens)
    kl = kl_per_position(ref, got)
    top1 = float((ref.argmax(-1) == got.argmax(-1)).mean())
    # Measured (551 tokens): KL mean 0.0048, max 0.037; same top-1 96.9% (the 17 other
    # positions are llama.cpp top-2 margins below 0.39). Bounds with margin for other builds:
    assert kl.mean() <= 0.01
    assert kl.max() <= 0.08
    assert top1 >= 0.94
    # Past the window. Measured: KL mean 0.0035, max 0.0088. A window that lets queries see
    # one position further (513) gives max 0.085 here (position 0 is an attention sink), no
    # window at all mean 0.015 / max 0.12.
    assert kl[WINDOW:].mean() <= 0.008
    assert kl[WINDOW:].max() <= 0.03


def test_greedy_continuations(gemma_path, ours, prompts):
    _, short = prompts
    got = our_greedy(ours, short, N_NEW)
    runs = llama_greedy(gemma_path, short, N_NEW)
    diverged = check_greedy(got, runs, ours, short, QUANT_NOISE)
    # Measured: 4 of 6 identical for 32 tokens; "The capital of France is" at step 5 (llama.cpp
    # margin 0.028, gap difference 0.31) and "Once upon a time..." at step 10 (gap difference
    # 0.31); on the F32 twin both continue exactly as ours do (test_f32_twin_greedy).
    assert len(diverged) <= len(short) // 2


# --- the F32 twin: nothing rounded on llama.cpp's side either -------------------------------------

@pytest.mark.slow
def test_f32_twin_logits(twin_path, ours, prompts):
    tokens, _ = prompts
    ref = llama_logits(twin_path, tokens)
    got = our_logits(ours, tokens)  # still reading the quantized file's blocks
    kl = kl_per_position(ref, got)
    # Float32 sums in other orders, llama.cpp's float16 GELU table and double-sum rms_norm.
    # Measured: max |Δlogit| 0.0225 (0.0041 of the logits' std), KL mean 3.6e-7, max 2.8e-6.
    assert np.abs(ref - got).max() <= 0.01 * ref.std()
    assert kl.mean() <= 5e-6 and kl.max() <= 3e-5
    top2 = np.sort(ref, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > TWIN_NOISE  # positions without a float32-level tie
    assert (ref.argmax(-1) == got.argmax(-1))[clear].all()


@pytest.mark.slow
def test_f32_twin_greedy(twin_path, ours, prompts):
    _, short = prompts
    got = our_greedy(ours, short, N_NEW)
    runs = llama_greedy(twin_path, short, N_NEW)
    # Measured: all six identical, through llama.cpp top-2 margins as small as 0.0047.
    assert check_greedy(got, runs, ours, short, TWIN_NOISE) == []
