"""Command-line options shared by generate, bench, eval and serve (no JAX import: --help stays quick)."""

from __future__ import annotations

PLACE_HELP = ("where routed experts run: card | cpu-moe | n-cpu-moe=N | last-cpu-moe=N | card-experts=N | "
              "budget=20GiB | override=REGEX (default card)")


WEIGHTS_HELP = ("card weights as the file's blocks (dequantized in every step), f32 copies (dequantized once; "
                "faster on the reference path, 4-8x the memory), or auto: f32 up to 2 GiB with no host experts "
                "(default auto)")


KERNELS_HELP = ("card matmuls: reference (jnp dequantize + matmul), pallas (GPU kernels on repacked weights; "
                "prefill products in three TF32 passes, close to f32), pallas-tf32 (one TF32 pass there: "
                "faster, ~5e-4 relative error a layer), pallas-qtiles (there the stored quants times x in two "
                "bf16 parts, scales applied after each sub-block, as llama.cpp's MMQ does), pallas-bf16 (the same in "
                "one bf16 part: faster, x rounded to bf16, finer than llama.cpp's Q8_1 rows), pallas-q8 "
                "(activations rounded to Q8_1 as llama.cpp's CUDA backend does; integer dot products at decode, int8 "
                "tiles at prefill), pallas-q8-bf16 (its integer dot products at decode, pallas-bf16's tiles at prefill) "
                "or auto: pallas-q8-bf16 on a GPU (default auto)")


ATTENTION_HELP = ("attention: xla (jnp; on the GPU each layer's cache is copied out and attended "
                  "over in full under a mask), pallas (decode and flash prefill kernels reading only each "
                  "sequence's visible positions straight from the cache) or auto (pallas on a GPU for models "
                  "that have it, else xla; the default)")


ROUTING_HELP = ("MoE routing: xla (softmax, sort and gather: three or four kernels a layer on the GPU), "
                "pallas (one kernel, which also looks up the placement), pallas-tickets (as pallas, but at "
                "decode the router's launch routes in its last program, the o and down launches add the "
                "residual in theirs, and attention is one launch; experimental, not yet measured on a card) or auto (pallas on a GPU for "
                "models that have it, else xla; the default)")


BRIDGE_HELP = ("how the step reaches the host experts: callback (jax.pure_callback: syncs and copies through "
               "Python) or ffi (an XLA FFI custom call into the compiled kernel, built on first use with the "
               "system's C++ compiler; on a GPU it is queued on the step's stream) or auto (ffi on a GPU, "
               "else callback; the default)")


def add_residency_args(parser, record_routing: bool = True) -> None:
    """The adaptive-residency options shared by generate, bench and serve."""
    parser.add_argument("--residency", choices=("off", "lfu", "lru"), default="off",
                        help="swap routed experts between the card slots and the host as routing is counted "
                             "(needs host experts; default off)")
    parser.add_argument("--no-prompt-streaming", action="store_true",
                        help="with --residency: do not seat a prompt's hottest experts when it ends")
    parser.add_argument("--max-swaps", type=int, default=None,
                        help="with --residency: most swaps per layer per decode step (default: no cap)")
    if record_routing:
        parser.add_argument("--record-routing", metavar="TRACE.npz",
                            help="save every step's routing (for scripts/placement_sweep.py)")
