"""The engine: N sequence slots on the device, chunked prefill, bucketed decode, rollback.

Contract. ``Engine(model)`` owns the KV cache (:class:`SlotCache`) and the sampler state of
``n_slots`` sequences. A :class:`Sequence` is a token list (prompt, then generated tokens) of
which the first ``n_cached`` have their keys/values in the cache; its *pending* tokens are fed
next. ``prefill(seq)`` feeds up to ``ubatch`` pending tokens (padded to a chunk length of
:func:`steps.chunk_lengths`); ``decode(seqs)`` feeds the one pending token of each sequence in
one step of the smallest bucket that holds them. When the last pending token has been fed, a
new token is sampled, appended, and returned. ``rollback(seq, n)`` truncates a sequence to
its first n tokens: the result is as if the later tokens had never been decoded.

Live sequences always occupy slots ``[0, n)``: releasing one moves the highest slot's sequence
into the hole (one copy of a slot), so the decode bucket only depends on how many are live.
Nothing here blocks on the device except reading the sampled tokens back.

Lookahead. ``decode_block(seqs, n, ahead=True)`` also launches the next block of the same
sequences, fed on the device by this block's last tokens, before it reads this block's tokens
back: the host's work between two blocks (the read, the caller's stop checks, the next launch)
then overlaps the card's. The next ``decode_block`` of the same sequences, n and sampler plan
takes that block instead of launching one. Any other call first drops it: its sequences' cache
lengths and sampler rows go back to what their tokens say, as a rollback would set them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError
from ..ops.experts import streams_host_experts
from ..placement.table import card_calls
from . import cache as cache_ops
from . import sampling
from .cache import SlotCache
from .steps import StepFunctions, bucket_for, chunk_lengths, decode_buckets


@dataclasses.dataclass
class Sampled:
    """One sampled token on the host, with its raw log-probability and the top-n list."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class _Block:
    """A launched decode block whose tokens are not read yet."""

    seqs: list  # the Sequences, in the order of their sampled tokens
    slots: list[int]  # their slots at the launch
    n: int
    plan: sampling.Plan
    positions: np.ndarray  # int32 [b]: the first step's
    active: np.ndarray  # bool [b]
    parity: int  # which of the step's two output sets it writes (steps.StepFunctions.decode_block)
    placement: object  # the placement it ran under, for counting card-served calls
    out: sampling.SampleOut  # on the device, [n, b, ...]
    routing: object  # on the device, [n, ...]


@dataclasses.dataclass(eq=False)
class Sequence:
    tokens: list[int]
    n_prompt: int
    params: sampling.SamplingParams
    slot: int
    n_cached: int = 0

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.n_cached

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt


def _default_min_rows() -> int:
    # XLA:CPU runs a one-row matmul as a GEMV that sums in another order than its GEMM path
    # (>= 2 rows, bit-identical for any row count, measured); two rows keep a lone sequence's
    # numbers equal to the same sequence decoded beside others. GPUs gain nothing from it.
    return 2 if jax.default_backend() == "cpu" else 1


PALLAS_CACHE_ELEMENTS = 2 ** 31  # the Pallas attention kernels address a cache buffer with int32 offsets


class Engine:
    """Continuous-batching engine over one loaded model.

    Args:
      model: a ``models.loader.Model`` (params, cfg, module with ``forward``).
      n_slots: sequences that can be live at once.
      max_context: positions per slot (prompt + generated); default min(model context, 4096).
      ubatch: most prompt tokens fed in one prefill step (<= 4096).
      min_chunk: shortest padded prefill chunk.
      kv_dtype: float32 | bfloat16 | float16.
      n_top: width of the top log-probability report (the most any request may ask).
      min_rows: smallest decode bucket (default 2 on the CPU, see _default_min_rows).
      placement: the expert placement handed to the forward (default: the model's own).
      residency: a ``placement.slots.LiveResidency`` swapping experts between steps, or None.
      routing_trace: a ``placement.trace.TraceRecorder`` receiving every step's routing, or None.
    """

    def __init__(self, model, *, n_slots: int = 4, max_context: int | None = None, ubatch: int = 512,
                 min_chunk: int = 16, kv_dtype: str = "float32", n_top: int = sampling.MAX_N_PROBS,
                 min_rows: int | None = None, placement=None, residency=None,
                 routing_trace=None):
        cfg = model.cfg
        if max_context is None:
            max_context = min(int(getattr(cfg, "context_length", 4096)), 4096)
        for name, value, lo, hi in (("n_slots", n_slots, 1, 4096), ("max_context", max_context, 2, 1 << 24),
                                    ("ubatch", ubatch, 1, 4096), ("n_top", n_top, 0, 1024)):
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ConfigError(f"engine {name}={value!r}: must be an integer in [{lo}, {hi}]")
        if kv_dtype not in cache_ops.KV_DTYPES:
            raise ConfigError(f"engine kv_dtype={kv_dtype!r}: must be one of {sorted(cache_ops.KV_DTYPES)}")
        self.model = model
        self.cfg = cfg
        self.params = model.params
        self.placement = placement if placement is not None else getattr(model, "placement", None)
        self.residency = residency
        self.routing_trace = routing_trace
        self.card_calls = self.routed_calls = 0  # routed (token, expert) calls, and those the card served
        self.n_vocab = int(cfg.n_vocab)
        self.max_context = max_context
        self.ubatch = ubatch
        self.chunks = chunk_lengths(ubatch, max(1, min(min_chunk, ubatch)))
        self.buckets = decode_buckets(n_slots, min_rows or _default_min_rows())
        self.n_slots = n_slots
        self.n_top = n_top
        rows = self.buckets[-1]  # the largest bucket's window must fit in the cache
        empty = sampling.row_arrays(sampling.SamplingParams(temperature=0.0), self.n_vocab)
        # Committed to the device like every step output: jit keys committed and uncommitted
        # arrays apart, so fresh uncommitted state would compile each step a second time.
        device = jax.devices()[0]
        if getattr(cfg, "attention", "xla") == "pallas":  # checked before the cache is made
            elements = cfg.n_layers * rows * max_context * cfg.n_kv_heads * cfg.head_dim
            if elements >= PALLAS_CACHE_ELEMENTS:
                raise ConfigError(
                    f"attention='pallas' reads the KV cache with int32 offsets: a buffer of {elements:,} elements "
                    f"({cfg.n_layers} layers x {rows} slots x {max_context} positions x {cfg.n_kv_heads} kv heads x "
                    f"{cfg.head_dim}) is over its {PALLAS_CACHE_ELEMENTS:,}; lower max_context or parallel, or take "
                    "attention='xla'")
        self.cache = jax.device_put(SlotCache.for_config(cfg, rows, max_context, kv_dtype), device)
        self.sampler = jax.device_put(sampling.make_rows([empty] * rows), device)
        self.steps = StepFunctions(model.module.forward, cfg, n_top)
        # sampler plans not to pick yet (each would compile in the step that first needs it):
        # their batches take the full plan, which serves every row (the server compiles the
        # greedy plan while idle)
        self.cold_plans: set[sampling.Plan] = set()
        self.live: list[Sequence] = []  # live[i].slot == i
        self.last_routing = None
        self._device = device
        self._ahead: _Block | None = None  # a block launched ahead, unread (module docstring)
        self._parity = 0  # the output set of the last block launched

    # --- sequences --------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return self.n_slots - len(self.live)

    def check_request(self, prompt: Seq[int], params: sampling.SamplingParams) -> list[int]:
        """The prompt as a list of ints; ConfigError for an empty or too long prompt, an id
        outside the vocabulary, or an impossible sampling value."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ConfigError("prompt is empty: it needs at least one token")
        if len(prompt) >= self.max_context:
            raise ConfigError(f"prompt of {len(prompt)} tokens does not fit the context of {self.max_context}")
        bad = [t for t in prompt if not 0 <= t < self.n_vocab]
        if bad:
            raise ConfigError(f"prompt token id {bad[0]} is not in [0, {self.n_vocab})")
        params.validate(self.n_vocab, self.n_top)
        return prompt

    def add(self, prompt: Seq[int], params: sampling.SamplingParams) -> Sequence:
        """Start a sequence in a free slot. ConfigError on a bad prompt or bad parameters."""
        self._settle()
        prompt = self.check_request(prompt, params)
        if not self.free_slots:
            raise ConfigError(f"all {self.n_slots} slots are busy")
        seq = Sequence(prompt, len(prompt), params, slot=len(self.live))
        self.live.append(seq)
        self._reset_slot(seq)
        return seq

    def release(self, seq: Sequence) -> None:
        """Free a sequence's slot; the highest live sequence moves into it to keep slots dense."""
        self._settle()
        i = self.live.index(seq)
        last = self.live.pop()
        if last is not seq:
            self.cache = cache_ops.move_slot(self.cache, last.slot, i)
            self.sampler = self.steps.move_row(self.sampler, last.slot, i)
            last.slot = i
            self.live[i] = last
        seq.slot = -1
        if self.residency is not None:
            self.residency.forget(id(seq))

    def rollback(self, seq: Sequence, n_tokens: int) -> None:
        """Truncate ``seq`` to its first ``n_tokens`` tokens (1 <= n_tokens <= len).

        The cache keeps positions ``< n_tokens - 1``; the last kept token is pending again, so
        the next step recomputes its logits. Sampler counts and the step index (hence the random
        stream) return to what they were when that token was sampled.
        """
        if not 1 <= n_tokens <= len(seq.tokens):
            raise ConfigError(f"rollback to {n_tokens} tokens: the sequence has {len(seq.tokens)}")
        self._settle()
        del seq.tokens[n_tokens:]
        seq.n_cached = min(seq.n_cached, n_tokens - 1)
        self._reset_slot(seq)

    def _reset_slot(self, seq: Sequence) -> None:
        self.cache = cache_ops.set_length(self.cache, seq.slot, seq.n_cached)
        row = sampling.row_arrays(seq.params, self.n_vocab, seq.tokens[: seq.n_prompt], seq.tokens[seq.n_prompt :])
        self.sampler = self.steps.set_row(self.sampler, seq.slot, sampling.SamplerRows(**row))

    # --- steps ------------------------------------------------------------------------------
    def prefill(self, seq: Sequence, budget: int | None = None) -> Sampled | None:
        """Feed up to min(ubatch, budget) pending tokens of ``seq`` (at least 2 must be pending).

        Returns the sampled token when the chunk held the last pending token, else None.
        """
        n = min(seq.pending, self.ubatch, budget or self.ubatch)
        if seq.pending < 2 or n < 1:
            raise ValueError(f"prefill needs >= 2 pending tokens and a budget >= 1 (pending {seq.pending})")
        if seq.n_cached + seq.pending > self.max_context:
            raise ConfigError(f"sequence of {len(seq.tokens)} tokens does not fit the context of {self.max_context}")
        self._settle()
        T = bucket_for(self.chunks, n)
        tokens = np.zeros((1, T), np.int32)
        positions = np.full((1, T), self.max_context, np.int32)  # padding: position S, never stored
        tokens[0, :n] = seq.tokens[seq.n_cached : seq.n_cached + n]
        positions[0, :n] = np.arange(seq.n_cached, seq.n_cached + n)
        final = n == seq.pending
        self.cache, self.sampler, out, _, self.last_routing = self.steps.prefill(
            self.params, self.cache, self.sampler, self.placement, tokens, positions,
            np.int32(seq.slot), np.int32(n - 1), np.bool_(final))
        seq.n_cached += n
        self._observe_routing(positions < self.max_context, seq, final)
        if not final:
            return None
        return self._record([seq], out)[0]

    def decode(self, seqs: Seq[Sequence]) -> list[Sampled]:
        """One token for each sequence (each must have exactly one pending token)."""
        if not seqs:
            return []
        self._settle()
        tokens, positions, active = self._decode_inputs(seqs)
        self.cache, self.sampler, out, _, self.last_routing = self.steps.decode(
            self.params, self.cache, self.sampler, self.placement, tokens, positions, active, self.sampler_plan(seqs))
        for s in seqs:
            s.n_cached += 1
        self._observe_routing(active[:, None])
        return self._record(seqs, out, rows=[s.slot for s in seqs])

    def decode_block(self, seqs: Seq[Sequence], n: int, ahead: bool = False) -> list[list[Sampled]]:
        """n tokens for each sequence in one device call (``StepFunctions.decode_block``): the
        same tokens, cache and sampler state as n :meth:`decode` calls, one list per step. The
        caller drops what follows a sequence's stop. Adaptive residency counts every step's
        routing and swaps experts after the block.

        ``ahead``: also launch the next block of these sequences before reading this one (see the
        module docstring), where every sequence has room for both."""
        if n < 1:
            raise ValueError(f"decode_block needs n >= 1, got {n}")
        if n == 1 or not seqs:
            return [self.decode(seqs) for _ in range(n)]
        plan = self.sampler_plan(seqs)
        block = self._take_ahead(seqs, n, plan)
        if block is None:
            self._settle()
            tokens, positions, active = self._decode_inputs(seqs, n)
            block = self._launch(seqs, n, plan, tokens, positions, active, self._parity)
        if ahead and all(s.n_cached + 2 * n <= self.max_context for s in seqs):
            # fed by this block's last tokens on the device; the other output set, as this
            # block's outputs are still to be read
            self._ahead = self._launch(seqs, n, plan, block.out.token[-1],
                                       np.where(block.active, block.positions + n, block.positions).astype(np.int32),
                                       block.active, 1 - block.parity)
        return self._read(block)

    def _launch(self, seqs, n, plan, tokens, positions, active, parity) -> _Block:
        # tokens committed to the device, as a block's last tokens are when they feed the next:
        # jit keys committed and uncommitted arguments apart
        tokens = jax.device_put(tokens, self._device)
        self.cache, self.sampler, out, routing = self.steps.decode_block(
            self.params, self.cache, self.sampler, self.placement, tokens, positions, active, n, plan, parity)
        self._parity = parity
        return _Block(list(seqs), [s.slot for s in seqs], n, plan, positions, active, parity, self.placement,
                      out, routing)

    def _read(self, block: _Block) -> list[list[Sampled]]:
        """The block's tokens on the host, appended to its sequences; its routing counted."""
        seqs, n, active = block.seqs, block.n, block.active
        self.last_routing = jax.tree.map(lambda a: a[-1], block.routing)
        experts = np.asarray(block.routing.experts) if self._routing_read() else None  # [n, L, b, 1, k]
        host_out = jax.device_get(block.out)  # [n, b, ...] each
        result = []
        for j in range(n):
            for s in seqs:
                s.n_cached += 1
            if experts is not None:
                self._observe_routing(active[:, None], experts=experts[j], swap=j == n - 1,
                                      placement=block.placement)
            result.append(self._sampled(seqs, [field[j] for field in host_out], block.slots))
        return result

    def _take_ahead(self, seqs, n: int, plan) -> _Block | None:
        """The block launched ahead when it is the one asked for (the same sequences in the same
        slots and order, n and plan); it stays for :meth:`_settle` otherwise."""
        block = self._ahead
        if (block is None or block.n != n or block.plan != plan or len(block.seqs) != len(seqs)
                or any(a is not b or a.slot != slot for a, b, slot in zip(block.seqs, seqs, block.slots))):
            return None
        self._ahead = None
        return block

    def _settle(self) -> None:
        """Drop a block launched ahead that nobody read: its sequences' cache lengths and sampler
        rows go back to what their tokens say (what it wrote past those lengths is never read)."""
        block, self._ahead = self._ahead, None
        if block is not None:
            for s, slot in zip(block.seqs, block.slots):
                if s.slot == slot:
                    self._reset_slot(s)

    def sampler_plan(self, seqs) -> sampling.Plan:
        """The sampler plan of a decode batch: only its sequences' settings count (padding rows'
        tokens are never read); the full plan while the batch's own is in ``cold_plans``."""
        plan = sampling.plan_for([s.params for s in seqs], self.n_top)
        return self.steps.full if plan in self.cold_plans else plan

    def _decode_inputs(self, seqs, n: int = 1):
        """Bucket-shaped decode inputs (tokens, positions, active) for ``seqs``, each of which must
        have one pending token and room for n more positions."""
        b = bucket_for(self.buckets, len(self.live))
        tokens = np.zeros(b, np.int32)
        positions = np.full(b, self.max_context, np.int32)
        active = np.zeros(b, bool)
        for s in seqs:
            if s.pending != 1:
                raise ValueError(f"decode needs exactly one pending token (slot {s.slot} has {s.pending})")
            if s.n_cached + n > self.max_context:
                raise ConfigError(f"sequence at position {s.n_cached} has no room for {n} more token(s) in the "
                                  f"context of {self.max_context}")
            tokens[s.slot] = s.tokens[-1]
            positions[s.slot] = s.n_cached
            active[s.slot] = True
        return tokens, positions, active

    @property
    def _hybrid(self) -> bool:
        return self.placement is not None and self.placement.host is not None

    def _routing_read(self) -> bool:
        """Does anything read a step's routing on the host (trace, residency, hybrid counters)?"""
        return self.routing_trace is not None or self.residency is not None or self._hybrid

    def _observe_routing(self, mask, seq: Sequence | None = None, prompt_done: bool = False,
                         experts=None, swap: bool = True, placement=None) -> None:
        """Count card-served calls under ``placement`` (default the engine's: the one the step ran
        under, unless it was launched ahead of a swap); hand the routing (``experts`` [L, B, T,
        k], default the last step's) to the trace recorder and the residency controller (which
        swaps experts only when ``swap``: after a block's last step)."""
        if not self._routing_read():
            return
        experts = np.asarray(self.last_routing.experts if experts is None else experts)  # [L, B, T, k]
        if self._hybrid:
            table = (placement or self.placement).slot_of
            card, routed = card_calls(table, experts[:, np.asarray(mask, bool)])  # real tokens
            if streams_host_experts(np.size(mask)):  # the step streamed its host experts: all on the card
                card = routed
            self.card_calls += card
            self.routed_calls += routed
        if self.routing_trace is not None:
            self.routing_trace.append(experts, "prefill" if seq is not None else "decode", mask)
        if self.residency is not None:
            self.residency.after_step(self, experts, mask, prompt_key=None if seq is None else id(seq),
                                      prompt_done=prompt_done, swap=swap)

    def _record(self, seqs, out: sampling.SampleOut, rows=None) -> list[Sampled]:
        # all four copies started before any wait
        return self._sampled(seqs, jax.device_get(out), rows if rows is not None else [0] * len(seqs))

    @staticmethod
    def _sampled(seqs, host_out, rows) -> list[Sampled]:
        """Append each sequence's token from a SampleOut on the host (fields [B, ...])."""
        token, logprob, top_ids, top_lp = host_out
        result = []
        for s, r in zip(seqs, rows):
            t = int(token[r])
            s.tokens.append(t)
            k = s.params.n_probs
            result.append(Sampled(t, float(logprob[r]), [(int(i), float(v)) for i, v in zip(top_ids[r, :k], top_lp[r, :k])]))
        return result

    def prefill_plan(self, n_tokens: int) -> list[int]:
        """The padded chunk lengths that feeding ``n_tokens`` pending tokens will use, in order."""
        plan = []
        while n_tokens > 1:  # the last single pending token goes through decode
            n = min(n_tokens, self.ubatch)
            plan.append(bucket_for(self.chunks, n))
            n_tokens -= n
        return plan

    # --- compilation ------------------------------------------------------------------------
    def warmup(self, progress: Callable[[str], None] | None = None, chunks: Seq[int] | None = None,
               buckets: Seq[int] | None = None, decode_block: int = 1,
               samplers: Seq[sampling.SamplingParams] | None = None) -> float:
        """Compile every prefill chunk length and decode bucket (or the ones given), and with
        ``decode_block`` > 1 the block of that many decode steps of each bucket; returns seconds.
        Each decode step compiles for the sampler plans of ``samplers`` (default: a greedy
        request and a sampled one with logprobs, i.e. both plans).

        Runs each step with padding rows only, so the cache and the sampler state are unchanged.
        """
        self._settle()
        t0 = time.perf_counter()
        S = self.max_context
        chunks = self.chunks if chunks is None else chunks
        buckets = self.buckets if buckets is None else buckets
        if samplers is None:
            samplers = [sampling.SamplingParams(temperature=0.0), sampling.SamplingParams(n_probs=1)]
        plans = sorted({sampling.plan_for([p], self.n_top) for p in samplers})
        todo = ([("prefill", T, None) for T in chunks] + [("decode", b, p) for b in buckets for p in plans]
                + [("decode block", b, p) for b in (buckets if decode_block > 1 else []) for p in plans])
        for i, (kind, n, plan) in enumerate(todo):
            if progress:
                what = f"{kind} {n}" + ("" if plan is None else f" ({'full' if plan.draw else 'greedy'} sampler)")
                progress(f"compiling {what} ({i + 1}/{len(todo)}, {time.perf_counter() - t0:.1f} s)")
            if kind == "prefill":
                res = self.steps.prefill(self.params, self.cache, self.sampler, self.placement,
                                         np.zeros((1, n), np.int32), np.full((1, n), S, np.int32),
                                         np.int32(0), np.int32(0), np.bool_(False))
            elif kind == "decode":
                res = self.steps.decode(self.params, self.cache, self.sampler, self.placement,
                                        np.zeros(n, np.int32), np.full(n, S, np.int32), np.zeros(n, bool), plan)
            else:
                res = self.steps.decode_block(self.params, self.cache, self.sampler, self.placement,
                                              jax.device_put(np.zeros(n, np.int32), self._device),
                                              np.full(n, S, np.int32), np.zeros(n, bool), decode_block, plan)
            self.cache, self.sampler = res[0], res[1]
            jax.block_until_ready(res[2])
        # The slot operations, as no-ops on slot 0, so that admitting and releasing never compile.
        n0 = int(self.slot_lengths()[0])
        self.cache = cache_ops.move_slot(cache_ops.set_length(self.cache, 0, n0), 0, 0)
        row0 = sampling.SamplerRows(*(x[0] for x in sampling.take_rows(self.sampler, 0, 1)))
        self.sampler = self.steps.move_row(self.steps.set_row(self.sampler, 0, row0), 0, 0)
        jax.block_until_ready(self.sampler)
        return time.perf_counter() - t0

    def slot_lengths(self) -> np.ndarray:
        """Filled positions of every slot (host copy; for tests and /slots), after dropping a
        block launched ahead."""
        self._settle()
        return np.asarray(self.cache.all_lengths)
