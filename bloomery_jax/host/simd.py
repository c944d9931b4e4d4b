"""AVX2 block sums for the K-quant · Q8_K row dots, written as LLVM vector IR (Numba intrinsics).

Why: LLVM does not form ``vpmaddubsw`` (unsigned 8-bit × signed 8-bit, pairwise into int16)
from plain loops (``blocks``' module docstring, trap list), so the portable kernels widen every
quant to int16 and multiply by the sub-block scale before the dot: about 9 GB/s a core from L2
for Q4_K on the 2-core znver4 VM. Here each 32 quants are one ``vpmaddubsw`` against the
activations and one ``vpmaddwd`` against the sub-block scale, and the 6-bit scales and mins are
unpacked with four 32-bit word operations instead of sixteen byte extractions.

Contract. Each intrinsic returns exact int32 block sums, equal to the portable kernels' integer
sums (every product and partial sum fits its lane: Q4_K/Q5_K ``31 * 128 * 2`` per int16 pair, Q6_K
``(q - 32) x`` pairs within ``32 * 128 * 2``; scales at most 63 / 128):

- :func:`q4k_block_sums` ``(row, o, xq, x0, xb, j) -> (sum_j s_j sum_l q x, sum_j m_j xb_j)``
  for the Q4_K block at byte ``o`` of ``row`` and activations ``xq[x0 : x0 + 256]``
  (``xb[j : j + 8]``: their sums per 32); :func:`q5k_block_sums` the same for Q5_K;
- :func:`q6k_block_sum` ``(row, o, xq, x0) -> sum_g c_g sum_l (q - 32) x`` for a Q6_K block.

``xq`` is the Q8_K quants as int16 (``blocks.quantize_q8_k``'s layout; values fit int8, so the
narrowing in the intrinsic is exact). The intrinsics exist only where the host CPU has AVX2
(:data:`HAS_AVX2`); ``blocks`` picks them at import, and the portable kernels stay the rest's.
"""

from __future__ import annotations

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

HAS_AVX2 = "+avx2" in llvm_binding.get_host_cpu_features().flatten().split(",")

I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
V32I8, V32I16, V16I8, V16I16 = ir.VectorType(I8, 32), ir.VectorType(I16, 32), ir.VectorType(I8, 16), ir.VectorType(I16, 16)
V8I8, V8I32 = ir.VectorType(I8, 8), ir.VectorType(I32, 8)


def _fn(builder, name, ret, *args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, list(args)), name)


def _data(context, builder, aryty, ary):
    return context.make_array(aryty)(context, builder, ary).data


def _load(builder, ptr, offset, vty):
    """An unaligned vector load of ``vty`` at element ``offset`` of ``ptr``."""
    return builder.load(builder.bitcast(builder.gep(ptr, [offset]), vty.as_pointer()), align=1)


def _at(builder, base, k):
    return builder.add(base, ir.Constant(base.type, k))


def _const(ty, n, value):
    return ir.Constant(ir.VectorType(ty, n), [value] * n)


def _lanes(builder, vec, picks):
    """A vector whose lane i is lane ``picks[i]`` of ``vec``."""
    return builder.shuffle_vector(vec, ir.Constant(vec.type, ir.Undefined), ir.Constant(ir.VectorType(I32, len(picks)), picks))


def _x8(builder, xp, x0, k):
    """32 activations at ``x0 + k`` (int16 in memory, int8 in value) as <32 x i8>."""
    return builder.trunc(_load(builder, xp, _at(builder, x0, k), V32I16), V32I8)


def _word(builder, rp, o, k):
    return builder.load(builder.bitcast(builder.gep(rp, [_at(builder, o, k)]), I32.as_pointer()), align=1)


def _k_block_sums(fifth_bit: bool):
    """The Q4_K (``fifth_bit`` False) or Q5_K block-sums intrinsic: the same scales and mins,
    Q5_K's quants at byte 48 with bit j of ``qh[l]`` (32 bytes at byte 16) as sub-block j's 5th bit."""

    def block_sums(typingctx, row, o, xq, x0, xb, j):
        sig = types.UniTuple(types.int32, 2)(row, o, xq, x0, xb, j)

        def codegen(context, builder, signature, args):
            row_v, o_v, xq_v, x0_v, xb_v, j_v = args
            rp = _data(context, builder, signature.args[0], row_v)
            xp = _data(context, builder, signature.args[2], xq_v)
            bp = _data(context, builder, signature.args[4], xb_v)
            maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, V32I8, V32I8)
            maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, V16I16, V16I16)
            reduce = _fn(builder, "llvm.vector.reduce.add.v8i32", I32, V8I32)
            # the 12 scale bytes as three words: scales s0-3 | s4-7 and mins m0-3 | m4-7, one byte each
            w0, w1, w2 = (_word(builder, rp, o_v, k) for k in (4, 8, 12))
            c = lambda v: ir.Constant(I32, v)  # noqa: E731
            low6, low4, low2 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)
            s03 = builder.and_(w0, low6)
            s47 = builder.or_(builder.and_(w2, low4), builder.shl(builder.and_(builder.lshr(w0, c(6)), low2), c(4)))
            m03 = builder.and_(w1, low6)
            m47 = builder.or_(builder.and_(builder.lshr(w2, c(4)), low4),
                              builder.shl(builder.and_(builder.lshr(w1, c(6)), low2), c(4)))

            def bytes8(lo, hi, wide):  # two words -> <8 x i8> -> zero-extended to <8 x wide>
                pair = ir.Constant(ir.VectorType(I32, 2), ir.Undefined)
                pair = builder.insert_element(builder.insert_element(pair, lo, c(0)), hi, c(1))
                return builder.zext(builder.bitcast(pair, V8I8), ir.VectorType(wide, 8))

            scales = bytes8(s03, s47, I16)
            mins = bytes8(m03, m47, I32)
            acc = _const(I32, 8, 0)
            q = _at(builder, o_v, 48 if fifth_bit else 16)
            qh = _load(builder, rp, _at(builder, o_v, 16), V32I8) if fifth_bit else None
            for g in range(4):  # 32 bytes: low nibbles are sub-block 2g, high nibbles 2g + 1
                w = _load(builder, rp, _at(builder, q, 32 * g), V32I8)
                nibbles = (builder.and_(w, _const(I8, 32, 15)), builder.lshr(w, _const(I8, 32, 4)))
                for nib, sub in zip(nibbles, (2 * g, 2 * g + 1)):
                    if fifth_bit:
                        bit = builder.and_(builder.lshr(qh, _const(I8, 32, sub)), _const(I8, 32, 1))
                        nib = builder.or_(nib, builder.shl(bit, _const(I8, 32, 4)))
                    pairs = builder.call(maddubs, [nib, _x8(builder, xp, x0_v, 32 * sub)])  # <16 x i16>
                    acc = builder.add(acc, builder.call(maddwd, [pairs, _lanes(builder, scales, [sub] * 16)]))
            quant_sum = builder.call(reduce, [acc])
            min_sum = builder.call(reduce, [builder.mul(mins, _load(builder, bp, j_v, V8I32))])
            return context.make_tuple(builder, signature.return_type, [quant_sum, min_sum])

        return sig, codegen

    block_sums.__name__ = "q5k_block_sums" if fifth_bit else "q4k_block_sums"
    return intrinsic(block_sums)


q4k_block_sums = _k_block_sums(False)
q5k_block_sums = _k_block_sums(True)


@intrinsic
def q6k_block_sum(typingctx, row, o, xq, x0):
    sig = types.int32(row, o, xq, x0)

    def codegen(context, builder, signature, args):
        row_v, o_v, xq_v, x0_v = args
        rp = _data(context, builder, signature.args[0], row_v)
        xp = _data(context, builder, signature.args[2], xq_v)
        maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, V32I8, V32I8)
        maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, V16I16, V16I16)
        reduce = _fn(builder, "llvm.vector.reduce.add.v8i32", I32, V8I32)
        scales = builder.sext(_load(builder, rp, _at(builder, o_v, 192), V16I8), V16I16)  # 16 int8 scales
        thirty_two = _const(I8, 32, 32)
        acc = _const(I32, 8, 0)
        for h in range(2):  # two halves of 128: ql 64 bytes, qh 32 bytes each
            l0 = _load(builder, rp, _at(builder, o_v, 64 * h), V32I8)
            l1 = _load(builder, rp, _at(builder, o_v, 64 * h + 32), V32I8)
            hb = _load(builder, rp, _at(builder, o_v, 128 + 32 * h), V32I8)
            for g, low in enumerate((builder.and_(l0, _const(I8, 32, 15)), builder.and_(l1, _const(I8, 32, 15)),
                                     builder.lshr(l0, _const(I8, 32, 4)), builder.lshr(l1, _const(I8, 32, 4)))):
                high = builder.and_(builder.lshr(hb, _const(I8, 32, 2 * g)), _const(I8, 32, 3))
                quant = builder.or_(low, builder.shl(high, _const(I8, 32, 4)))  # 0..63, the stored q + 32
                x = _x8(builder, xp, x0_v, 128 * h + 32 * g)
                # (q - 32) x in pairs: both pair sums fit int16, and so does their difference
                pairs = builder.sub(builder.call(maddubs, [quant, x]), builder.call(maddubs, [thirty_two, x]))
                k = 8 * h + 2 * g  # elements 0-15 take scale k, 16-31 scale k + 1
                acc = builder.add(acc, builder.call(maddwd, [pairs, _lanes(builder, scales, [k] * 8 + [k + 1] * 8)]))
        return builder.call(reduce, [acc])

    return sig, codegen
