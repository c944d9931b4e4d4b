"""What the host launches for one compiled step: the entry computation of an optimized HLO dump.

Run the step under ``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text"`` first, then

    python scripts/hlo_launches.py DIR [--module decode]

It reads the newest ``*<module>*after_optimizations.txt`` in DIR and counts the instructions
of its ENTRY computation that run as their own thunk: each is one host-side launch (or copy),
except a ``call`` to a command buffer, which launches one CUDA graph holding many kernels.
Metadata-only instructions (parameter, constant, tuple, get-tuple-element, bitcast) are left
out. Custom calls are listed by target, since a ``__gpu$xla.gpu.triton`` (Pallas) call is not
a command and so ends a graph. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

NO_OPS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
# "%name = shape opcode(operands), attrs": the opcode is the word before the first "(" after " = "
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
TARGET = re.compile(r'custom_call_target="([^"]+)"')
CALLEE = re.compile(r"to_apply=%?([\w.\-]+)")


def entry_lines(text: str) -> list[str]:
    """The instruction lines of the ENTRY computation."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    body = []
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        body.append(line)
    return body


def count_launches(text: str) -> dict:
    ops = collections.Counter()
    targets = collections.Counter()
    for line in entry_lines(text):
        m = INSTRUCTION.match(line)
        if not m or m.group(1) in NO_OPS:
            continue
        op = m.group(1)
        if op == "custom-call":
            t = TARGET.search(line)
            targets[t.group(1) if t else "?"] += 1
        elif op == "call":
            callee = CALLEE.search(line)
            op = "call (command buffer)" if callee and "command_buffer" in callee.group(1) else "call"
        ops[op] += 1
    return dict(launches=sum(ops.values()), by_opcode=dict(ops.most_common()), custom_calls=dict(targets.most_common()))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dump_dir", type=Path)
    p.add_argument("--module", default="decode", help="a part of the module's name (jit__decode: decode)")
    a = p.parse_args(argv)
    files = sorted(a.dump_dir.glob(f"*{a.module}*after_optimizations.txt"), key=lambda f: f.stat().st_mtime)
    if not files:
        raise SystemExit(f"no *{a.module}*after_optimizations.txt under {a.dump_dir}")
    result = dict(file=files[-1].name, **count_launches(files[-1].read_text()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
