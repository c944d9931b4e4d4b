"""What a synthesis run produced: :class:`SynthReport` (also what the CLI prints)."""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass
class SynthReport:
    """The outcome of :func:`bloomery_jax.synth.synthesize`.

    Attributes:
      path: the file written.
      arch, qtype, seed, route_skew: what was asked for.
      config: the architecture Config's fields.
      bytes: size of the file.
      n_params: parameters (elements of all tensors).
      bytes_per_type: tensor data bytes per ggml type name.
      tensors_per_type: tensor count per ggml type name.
      fallbacks: "tensor: why" for every tensor that could not take its planned type.
      notes: other things the user should know (e.g. tensors drawn as random blocks).
      random_block_tensors: how many tensors were drawn as random quant blocks (fast path).
      seconds: wall time of the whole write; write_mb_per_s: file bytes / that time.
      twin_path, twin_bytes: the F32 twin, when asked for.
      hot_experts: hot expert ids per layer (empty without route skew).
      mean_max_prob: mean over positions of the top next-token probability from our own
        forward pass, or None when it was not measured.
    """

    path: str
    arch: str
    qtype: str
    seed: int
    route_skew: float
    config: dict
    bytes: int = 0
    n_params: int = 0
    bytes_per_type: dict = dataclasses.field(default_factory=dict)
    tensors_per_type: dict = dataclasses.field(default_factory=dict)
    fallbacks: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)
    random_block_tensors: int = 0
    seconds: float = 0.0
    write_mb_per_s: float = 0.0
    twin_path: str | None = None
    twin_bytes: int | None = None
    hot_experts: list = dataclasses.field(default_factory=list)
    mean_max_prob: float | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def __str__(self) -> str:
        lines = [
            f"wrote {self.path}: {self.arch} {self.qtype}, {self.bytes / 1e6:.1f} MB, "
            f"{self.n_params / 1e6:.2f} M parameters, in {self.seconds:.2f} s ({self.write_mb_per_s:.0f} MB/s)",
            "  " + ", ".join(f"{k}: {v / 1e6:.2f} MB in {self.tensors_per_type[k]} tensors"
                             for k, v in sorted(self.bytes_per_type.items())),
        ]
        if self.random_block_tensors:
            lines.append(f"  {self.random_block_tensors} tensors drawn as random quant blocks (fast path)")
        lines += [f"  fallback: {f}" for f in self.fallbacks]
        lines += [f"  note: {n}" for n in self.notes]
        if self.hot_experts:
            lines.append(f"  route skew {self.route_skew}: hot experts per layer {self.hot_experts}")
        if self.twin_path:
            lines.append(f"  F32 twin: {self.twin_path} ({self.twin_bytes / 1e6:.1f} MB)")
        mmp = "not measured" if self.mean_max_prob is None else f"{self.mean_max_prob:.3f}"
        lines.append(f"  mean max next-token probability: {mmp} (uniform: {1 / self.config['n_vocab']:.2g})")
        return "\n".join(lines)
