"""AVX2 row dots of the K-quants against Q8_K activations, written as LLVM vector IR (Numba intrinsics).

Why: LLVM does not form ``vpmaddubsw`` (unsigned 8-bit × signed 8-bit, pairwise into int16)
from plain loops (``blocks``' module docstring, trap list), so the portable kernels widen every
quant to int16 and multiply by the sub-block scale before the dot: about 9 GB/s a core from L2
for Q4_K on the 2-core znver4 VM. Here each 32 quants are one ``vpmaddubsw`` against the
activations and one ``vpmaddwd`` against the sub-block scale (``vpdpwssd`` where LLVM sees VNNI),
the 6-bit scales and mins are unpacked with four 32-bit word operations instead of sixteen byte
extractions, each block's eight int32 lanes are scaled into eight float32 accumulators (one
horizontal sum a row, not two a block), and Q6_K's ``- 32`` offset is one ``vpmaddwd`` of the
scales with the activations' sums per 16 instead of a second ``vpmaddubsw`` per 32 quants.

Contract. ``q4k_row_dot(row, xq8, xd, xb)``, ``q5k_row_dot`` (same arguments) and
``q6k_row_dot(row, xq8, xd, x16)`` return float32 ``sum_b xd_b (d_b S_b - dmin_b M_b)`` over the
row's blocks (Q6_K: ``sum_b xd_b d_b S_b``), where ``S_b`` / ``M_b`` are the portable kernels'
exact int32 block sums (quant term / min term), summed lane by lane: each lane's share of a
block is an exact integer (Q4_K/Q5_K lanes below 2^23; Q6_K's below 2^25, where the conversion
to float may round once). Activations in ``blocks.pack_q8_k``'s form: ``xq8`` int8 ``[K]``,
``xd`` float32 ``[K / 256]``, ``xb`` int32 sums per 32, ``x16`` int16 sums per 16. The
intrinsics exist only where the host CPU has AVX2 (:data:`HAS_AVX2`); ``blocks`` picks them at
import, and the portable kernels stay the rest's.
"""

from __future__ import annotations

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

HAS_AVX2 = "+avx2" in llvm_binding.get_host_cpu_features().flatten().split(",")

I8, I16, I32, F32, HALF = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType(), ir.HalfType()
V32I8, V16I8, V16I16 = ir.VectorType(I8, 32), ir.VectorType(I8, 16), ir.VectorType(I16, 16)
V8I8, V8I32, V8F32 = ir.VectorType(I8, 8), ir.VectorType(I32, 8), ir.VectorType(F32, 8)


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


def _word(builder, rp, o, k):
    return builder.load(builder.bitcast(builder.gep(rp, [_at(builder, o, k)]), I32.as_pointer()), align=1)


def _half(builder, rp, o):
    """The float16 at byte ``o`` of ``rp`` as a float32 (exact)."""
    return builder.fpext(builder.load(builder.bitcast(builder.gep(rp, [o]), HALF.as_pointer()), align=1), F32)


def _splat(builder, v):
    """<8 x float> of one float."""
    vec = builder.insert_element(ir.Constant(V8F32, ir.Undefined), v, ir.Constant(I32, 0))
    return builder.shuffle_vector(vec, ir.Constant(V8F32, ir.Undefined), ir.Constant(V8I32, [0] * 8))


def _blocks(context, builder, aryty, ary, block_bytes):
    """The number of ``block_bytes`` blocks in the uint8 row ``ary``."""
    n = context.make_array(aryty)(context, builder, ary).nitems
    return builder.udiv(n, ir.Constant(n.type, block_bytes))


def _k_row_dot(fifth_bit: bool):
    """The Q4_K (``fifth_bit`` False, 144-byte blocks) or Q5_K (176) row-dot intrinsic: the same
    scales and mins; Q5_K's quants at byte 48 with bit j of ``qh[l]`` (32 bytes at byte 16) as
    sub-block j's 5th bit."""
    block_bytes = 176 if fifth_bit else 144

    def row_dot(typingctx, row, xq8, xd, xb):
        sig = types.float32(row, xq8, xd, xb)

        def codegen(context, builder, signature, args):
            row_v, xq_v, xd_v, xb_v = args
            rp, xp, dp, bp = (_data(context, builder, t, v) for t, v in zip(signature.args, args))
            maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, V32I8, V32I8)
            maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, V16I16, V16I16)
            quant_acc = cgutils.alloca_once_value(builder, _const(F32, 8, 0.0))
            min_acc = cgutils.alloca_once_value(builder, _const(F32, 8, 0.0))
            c = lambda v: ir.Constant(I32, v)  # noqa: E731
            with cgutils.for_range(builder, _blocks(context, builder, signature.args[0], row_v, block_bytes)) as loop:
                b = loop.index
                o = builder.mul(b, ir.Constant(b.type, block_bytes))
                x0 = builder.mul(b, ir.Constant(b.type, 256))
                # the 12 scale bytes as three words: scales s0-3 | s4-7 and mins m0-3 | m4-7, one byte each
                w0, w1, w2 = (_word(builder, rp, o, k) for k in (4, 8, 12))
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
                q = _at(builder, o, 48 if fifth_bit else 16)
                qh = _load(builder, rp, _at(builder, o, 16), V32I8) if fifth_bit else None
                for g in range(4):  # 32 bytes: low nibbles are sub-block 2g, high nibbles 2g + 1
                    w = _load(builder, rp, _at(builder, q, 32 * g), V32I8)
                    nibbles = (builder.and_(w, _const(I8, 32, 15)), builder.lshr(w, _const(I8, 32, 4)))
                    for nib, sub in zip(nibbles, (2 * g, 2 * g + 1)):
                        if fifth_bit:
                            bit = builder.and_(builder.lshr(qh, _const(I8, 32, sub)), _const(I8, 32, 1))
                            nib = builder.or_(nib, builder.shl(bit, _const(I8, 32, 4)))
                        x = _load(builder, xp, _at(builder, x0, 32 * sub), V32I8)
                        pairs = builder.call(maddubs, [nib, x])  # <16 x i16>
                        acc = builder.add(acc, builder.call(maddwd, [pairs, _lanes(builder, scales, [sub] * 16)]))
                min_ints = builder.mul(mins, _load(builder, bp, builder.mul(b, ir.Constant(b.type, 8)), V8I32))
                xdb = builder.load(builder.gep(dp, [b]))
                for ints, byte, ptr in ((acc, 0, quant_acc), (min_ints, 2, min_acc)):  # d, then dmin
                    scale = _splat(builder, builder.fmul(xdb, _half(builder, rp, _at(builder, o, byte))))
                    builder.store(builder.fadd(builder.load(ptr), builder.fmul(builder.sitofp(ints, V8F32), scale)), ptr)
            total = builder.fsub(builder.load(quant_acc), builder.load(min_acc))
            return builder.call(_fn(builder, "llvm.vector.reduce.fadd.v8f32", F32, F32, V8F32), [ir.Constant(F32, 0.0), total])

        return sig, codegen

    row_dot.__name__ = "q5k_row_dot" if fifth_bit else "q4k_row_dot"
    return intrinsic(row_dot)


q4k_row_dot = _k_row_dot(False)
q5k_row_dot = _k_row_dot(True)


@intrinsic
def q6k_row_dot(typingctx, row, xq8, xd, x16):
    sig = types.float32(row, xq8, xd, x16)

    def codegen(context, builder, signature, args):
        rp, xp, dp, sp = (_data(context, builder, t, v) for t, v in zip(signature.args, args))
        maddubs = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, V32I8, V32I8)
        maddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, V16I16, V16I16)
        quant_acc = cgutils.alloca_once_value(builder, _const(F32, 8, 0.0))
        with cgutils.for_range(builder, _blocks(context, builder, signature.args[0], args[0], 210)) as loop:
            b = loop.index
            o = builder.mul(b, ir.Constant(b.type, 210))
            x0 = builder.mul(b, ir.Constant(b.type, 256))
            scales = builder.sext(_load(builder, rp, _at(builder, o, 192), V16I8), V16I16)  # 16 int8 scales
            acc = _const(I32, 8, 0)
            for h in range(2):  # two halves of 128: ql 64 bytes, qh 32 bytes each
                l0 = _load(builder, rp, _at(builder, o, 64 * h), V32I8)
                l1 = _load(builder, rp, _at(builder, o, 64 * h + 32), V32I8)
                hb = _load(builder, rp, _at(builder, o, 128 + 32 * h), V32I8)
                for g, low in enumerate((builder.and_(l0, _const(I8, 32, 15)), builder.and_(l1, _const(I8, 32, 15)),
                                         builder.lshr(l0, _const(I8, 32, 4)), builder.lshr(l1, _const(I8, 32, 4)))):
                    high = builder.and_(builder.lshr(hb, _const(I8, 32, 2 * g)), _const(I8, 32, 3))
                    quant = builder.or_(low, builder.shl(high, _const(I8, 32, 4)))  # 0..63, the stored q + 32
                    x = _load(builder, xp, _at(builder, x0, 128 * h + 32 * g), V32I8)
                    k = 8 * h + 2 * g  # elements 0-15 take scale k, 16-31 scale k + 1
                    pairs = builder.call(maddubs, [quant, x])  # (q + 32) x in pairs: at most 2 * 63 * 128
                    acc = builder.add(acc, builder.call(maddwd, [pairs, _lanes(builder, scales, [k] * 8 + [k + 1] * 8)]))
            # minus 32 sum_k c_k (sum of x over the 16 of sub-block k)
            sums = _load(builder, sp, builder.mul(b, ir.Constant(b.type, 16)), V16I16)
            acc = builder.sub(acc, builder.shl(builder.call(maddwd, [scales, sums]), _const(I32, 8, 5)))
            scale = _splat(builder, builder.fmul(builder.load(builder.gep(dp, [b])), _half(builder, rp, _at(builder, o, 208))))
            builder.store(builder.fadd(builder.load(quant_acc), builder.fmul(builder.sitofp(acc, V8F32), scale)), quant_acc)
        return builder.call(_fn(builder, "llvm.vector.reduce.fadd.v8f32", F32, F32, V8F32),
                            [ir.Constant(F32, 0.0), builder.load(quant_acc)])

    return sig, codegen
