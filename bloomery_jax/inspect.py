"""``python -m bloomery_jax.inspect M.gguf [--json]``: what a GGUF file holds, for placement.

Prints the architecture, parameter count, bytes per ggml type and, for MoE models, the bytes
of one expert (gate + up + down of one expert, in their stored types) and of all experts of
each layer, split into what must stay on the card (attention, norms, router, embeddings,
output, shared experts, dense FFN) and what may live on the host (routed experts).

Each tensor's role comes from the architecture's ``tensor_specs`` when the architecture is
registered and its Config reads; otherwise (and for tensors the table does not name) from the
name: ``*_exps`` expert, ``*_shexp`` shared expert, ``ffn_gate_inp`` router, ``*norm*`` norm,
``attn_*`` attention, ``token_embd`` / ``output`` embeddings and output, other ``ffn_*`` dense.
Errors print one line to stderr and exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from .errors import BloomeryError
from .gguf_file import GGUFFile
from .models.spec import HOST_ELIGIBLE_ROLES

_LAYER = re.compile(r"^blk\.(\d+)\.")


def role_by_name(name: str) -> str:
    """The role of a tensor judged from its GGUF name alone."""
    base = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    if base.endswith("_exps") or "_exps." in name:
        return "expert"
    if base.endswith("_shexp") or "_shexp." in name:
        return "shared_expert"
    if "ffn_gate_inp" in base or "exp_probs_b" in base:
        return "router"
    if "norm" in base:
        return "norm"
    if base.startswith("token_embd"):
        return "embed"
    if base.startswith("output"):
        return "output"
    if ".attn_" in name:
        return "attn"
    if ".ffn_" in name:
        return "ffn"
    return "other"


def _roles(gf: GGUFFile) -> tuple[dict[str, str], str, list[str]]:
    """(name -> role, how they were classified, notes)."""
    from .models import registry

    notes = []
    by_spec: dict[str, str] = {}
    how = "name patterns"
    arch = gf.get("general.architecture")
    if isinstance(arch, str) and arch in registry.ARCHITECTURES:
        try:
            module = registry.arch_module(arch, gf.path)
            cfg = module.Config.from_gguf(gf)
            by_spec = {s.name: s.role for s in module.tensor_specs(cfg)}
            how = f"{arch} tensor_specs"
        except BloomeryError as e:
            notes.append(f"{arch} config unreadable ({e.problem}); roles from name patterns")
    roles = {name: by_spec.get(name) or role_by_name(name) for name in gf.tensors}
    unnamed = [n for n in gf.tensors if by_spec and n not in by_spec]
    if unnamed:
        notes.append(f"{len(unnamed)} tensors not in the architecture's table (by name): {', '.join(unnamed[:5])}")
    return roles, how, notes


def summarize(gf: GGUFFile) -> dict:
    """The inspection report as plain data (what ``--json`` prints)."""
    roles, how, notes = _roles(gf)
    per_type: dict[str, int] = {}
    per_role: dict[str, int] = {}
    n_params = 0
    layers: dict[int, dict] = {}
    n_experts = None
    for t in gf:
        per_type[t.qtype.name] = per_type.get(t.qtype.name, 0) + t.n_bytes
        role = roles[t.name]
        per_role[role] = per_role.get(role, 0) + t.n_bytes
        n_params += t.n_elements
        if role in HOST_ELIGIBLE_ROLES:
            m = _LAYER.match(t.name)
            layer = int(m.group(1)) if m else -1
            e = t.shape[0] if len(t.shape) == 3 else 1  # [E, rows, cols]: experts stacked
            n_experts = e if n_experts is None else max(n_experts, e)
            entry = layers.setdefault(layer, {"layer": layer, "n_experts": e, "one_expert_bytes": 0,
                                              "all_experts_bytes": 0, "types": {}})
            entry["all_experts_bytes"] += t.n_bytes
            entry["one_expert_bytes"] += t.n_bytes // e
            part = t.name.split(".")[-2] if t.name.count(".") >= 2 else t.name
            entry["types"][part] = t.qtype.name
    tensor_bytes = sum(per_type.values())
    host = sum(v for r, v in per_role.items() if r in HOST_ELIGIBLE_ROLES)
    moe = None
    if layers:
        rows = [layers[i] for i in sorted(layers)]
        ones = [r["one_expert_bytes"] for r in rows]
        moe = {
            "n_experts": n_experts,
            "n_experts_used": gf.get(f"{gf.get('general.architecture')}.expert_used_count"),
            "n_expert_layers": len(rows),
            "one_expert_bytes_min": min(ones),
            "one_expert_bytes_max": max(ones),
            "all_experts_bytes": host,
            "layers": rows,
        }
    return {
        "path": gf.path,
        "architecture": gf.get("general.architecture"),
        "name": gf.get("general.name"),
        "file_bytes": os.path.getsize(gf.path),
        "n_tensors": len(gf.tensors),
        "n_params": n_params,
        "tensor_bytes": tensor_bytes,
        "bytes_per_type": dict(sorted(per_type.items())),
        "bytes_per_role": dict(sorted(per_role.items())),
        "card_bytes": tensor_bytes - host,
        "host_eligible_bytes": host,
        "roles_from": how,
        "moe": moe,
        "notes": notes,
    }


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_text(s: dict) -> str:
    lines = [
        f"{s['path']}: {s['architecture']} ({s['name']}), {s['n_tensors']} tensors, "
        f"{s['n_params'] / 1e9:.3f} B parameters, {_size(s['tensor_bytes'])} of tensor data",
        "bytes per type: " + ", ".join(f"{k} {_size(v)}" for k, v in s["bytes_per_type"].items()),
        "bytes per role: " + ", ".join(f"{k} {_size(v)}" for k, v in s["bytes_per_role"].items())
        + f" (roles from {s['roles_from']})",
        "on the card (attention, norms, router, embeddings, output, shared experts, dense FFN): "
        f"{_size(s['card_bytes'])}",
        f"may live on the host (routed experts): {_size(s['host_eligible_bytes'])}",
    ]
    moe = s["moe"]
    if moe:
        used = f", top-{moe['n_experts_used']}" if moe["n_experts_used"] else ""
        one = (_size(moe["one_expert_bytes_min"]) if moe["one_expert_bytes_min"] == moe["one_expert_bytes_max"]
               else f"{_size(moe['one_expert_bytes_min'])} to {_size(moe['one_expert_bytes_max'])}")
        lines.append(f"MoE: {moe['n_experts']} experts{used} in {moe['n_expert_layers']} layers; "
                     f"one expert (gate+up+down) {one}")
        for r in moe["layers"]:
            types = "/".join(r["types"].values())
            lines.append(f"  layer {r['layer']:3d}: one expert {_size(r['one_expert_bytes'])}, "
                         f"all {r['n_experts']} {_size(r['all_experts_bytes'])} ({types})")
    lines += [f"note: {n}" for n in s["notes"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bloomery_jax.inspect", description=__doc__.splitlines()[0])
    p.add_argument("path", help="a GGUF file")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    try:
        s = summarize(GGUFFile(args.path))
    except BloomeryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(s, indent=2) if args.json else format_text(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
