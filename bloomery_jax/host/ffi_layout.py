"""Word layout of a host-bridge layer record: one int64 array per layer, read by ``entry`` (Numba)
and by ``ffi_bridge.cc`` (whose ``Field`` enum is generated from ``FIELDS`` at build time)."""

FIELDS = (
    "FN",  # address of the host function (entry.layer_entry)
    "SET_THREADS",  # address of Numba's set_num_threads(int) for the calling thread, called before FN
    "SET_CHUNKSIZE",  # address of Numba's set_parallel_chunksize(unsigned) for the calling thread, likewise
    "D", "F", "E", "K",  # model width, expert width, experts, experts per token
    "GATE", "UP", "DOWN",  # addresses of the expert tensors, uint8 [E, rows, row_bytes]
    "GATE_ROW_BYTES", "UP_ROW_BYTES", "DOWN_ROW_BYTES",
    "GATE_FMT", "UP_FMT", "DOWN_FMT", "Q8", "ROWS_PER_ITEM", "THREADS", "CHUNKSIZE", "MULTI_MIN1", "MULTI_MIN2",
    "PREFETCH_BYTES", "REGIONS", "PARTS",
    "TAB16", "TABBF",  # addresses of the f16 / bf16 conversion tables
    # CUDA only: pinned staging (tokens it holds; the packed inputs, out)
    "STAGE_TOKENS", "STAGE_IN", "STAGE_OUT",
    "SIGNAL",  # CUDA only: how the stream hands a call to the host (SIGNALS' index)
    "CALLS", "PAIRS", "NANOS",  # counters, added to by the host function
    "TICKS", "TICKS_REGIONS", "TICKS_WAKE", "TICKS_JOIN",  # the kernel's tick spans (swiglu.SPANS), likewise
    "STREAMED",  # expert bytes copied by the stream handler
    # The host team (ffi_bridge.cc): calls of at most TEAM_TOKENS tokens run on threads that stay
    # awake between calls (TEAM_SPIN_US after the last), each running TEAM_FN (entry.team_entry)
    # for its part; 0 in TEAM: every call runs FN. TEAM_SCRATCH: address of the addresses of
    # swiglu.team_scratch's arrays (TEAM_PAIRS rows); TEAM_COUNTERS: int64 [COUNTER_WORDS];
    # TEAM_PLAIN: 1 runs each part's shared items in the part's own function, without the
    # one-thread parallel region (swiglu._team_part).
    "TEAM", "TEAM_FN", "TEAM_TOKENS", "TEAM_SPIN_US", "TEAM_SCRATCH", "TEAM_PAIRS", "TEAM_COUNTERS", "TEAM_PLAIN",
    "TEAM_CALLS",  # calls the team ran, added to by the bridge
)
WORDS = len(FIELDS)
# The stream's ways of running the host function: "hostfunc" (cuLaunchHostFunc: the driver's
# callback thread runs it) or "doorbell" (the stream writes the call's id to pinned memory, a
# spinning worker of ours runs it and writes the id back, the stream waits for that value).
SIGNALS = ("hostfunc", "doorbell")
# The counters of a call whose threads take work as they free up (swiglu._share, and the
# two-region kernel's activation rows): int64 a cache line apart, each *_DONE right after its
# *_TAKEN, as TEAM_COUNTERS holds them and the kernels make them
COUNTERS = ("P1_TAKEN", "P1_DONE", "H_TAKEN", "H_DONE", "P2_TAKEN", "X_TAKEN", "X_DONE")
COUNTER_WORDS = 8 * len(COUNTERS)
# What a host-team thread stamps (host.ticks) in its cache line after TEAM_COUNTERS' counters
# (COUNTER_WORDS + 8 * tid + i; the memset of a call spares them): entering its part, the pairs
# grouped, its activation rows and work items made, entering the shared items, its phase-1 items
# finished, all of phase 1 finished, the hidden rows prepared, its part done. Read after a call
# (host_call_probe.py), they tell where a team call's time goes.
TEAM_STAMPS = ("enter", "grouped", "items", "share", "own_p1", "all_p1", "hidden", "done")
globals().update({name: i for i, name in enumerate(FIELDS)})


def c_header() -> str:
    """The ``Field`` enum and ``kCounterWords`` for ``ffi_bridge.cc``."""
    names = "".join(f"  k{name.title().replace('_', '')} = {i},\n" for i, name in enumerate(FIELDS))
    return f"enum Field : int {{\n{names}  kWords = {WORDS}\n}};\nconstexpr int kCounterWords = {COUNTER_WORDS};\n"
