"""AVX2 and AVX-512 row dots of the K-quants against Q8_K activations, as LLVM vector IR (Numba intrinsics).

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
intrinsics exist only where the host CPU has AVX2 (:data:`HAS_AVX2`); the ``_wide`` ones take 64
quants an instruction on zmm and need AVX-512BW (:data:`HAS_AVX512BW`). A core from L2, zmm
against ymm: 1.06-1.13x on the znver4 VM (which splits zmm work in two); on the H200 host's
Xeon 1.0x for Q4_K/Q5_K and 1.2x for Q6_K, yet the whole 16-thread layer ran 10 % slower, so
``blocks`` picks the AVX2 ones unless ``BLOOMERY_HOST_ISA=avx512``; the portable kernels serve
CPUs without AVX2.
"""

from __future__ import annotations

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_FEATURES = llvm_binding.get_host_cpu_features().flatten().split(",")
HAS_AVX2 = "+avx2" in _FEATURES
HAS_AVX512BW = "+avx512bw" in _FEATURES

I8, I16, I32, F32, HALF = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType(), ir.HalfType()
V32I8, V16I8, V16I16 = ir.VectorType(I8, 32), ir.VectorType(I8, 16), ir.VectorType(I16, 16)
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


def _word(builder, rp, o, k):
    return builder.load(builder.bitcast(builder.gep(rp, [_at(builder, o, k)]), I32.as_pointer()), align=1)


def _half(builder, rp, o):
    """The float16 at byte ``o`` of ``rp`` as a float32 (exact)."""
    return builder.fpext(builder.load(builder.bitcast(builder.gep(rp, [o]), HALF.as_pointer()), align=1), F32)


def _splat(builder, v, n=8):
    """<n x float> of one float."""
    vty = ir.VectorType(F32, n)
    vec = builder.insert_element(ir.Constant(vty, ir.Undefined), v, ir.Constant(I32, 0))
    return builder.shuffle_vector(vec, ir.Constant(vty, ir.Undefined), ir.Constant(ir.VectorType(I32, n), [0] * n))


def _cat(builder, a, b):
    """The concatenation of two vectors of one type."""
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, 2 * n), list(range(2 * n))))


def _reduce(builder, acc):
    n = acc.type.count
    return builder.call(_fn(builder, f"llvm.vector.reduce.fadd.v{n}f32", F32, F32, acc.type), [ir.Constant(F32, 0.0), acc])


def _accumulate(builder, ptr, ints, scale):
    """``*ptr += float(ints) * scale``: a block's int32 lanes into the row's float32 lanes."""
    n = ints.type.count
    lanes = builder.sitofp(ints, ir.VectorType(F32, n))
    builder.store(builder.fadd(builder.load(ptr), builder.fmul(lanes, _splat(builder, scale, n))), ptr)


class _Madd:
    """vpmaddubsw and vpmaddwd on ymm (AVX2) or zmm (AVX-512BW): ``lanes`` int32 results each."""

    def __init__(self, builder, wide: bool):
        self.lanes = 16 if wide else 8
        n = self.lanes
        v8, v16, v32 = ir.VectorType(I8, 4 * n), ir.VectorType(I16, 2 * n), ir.VectorType(I32, n)
        self.i32, self.f32 = v32, ir.VectorType(F32, n)
        names = ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512") if wide else \
            ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd")
        self._ubsw = _fn(builder, names[0], v16, v8, v8)
        self._wd = _fn(builder, names[1], v32, v16, v16)
        self.builder = builder

    def __call__(self, quants, x, scales):
        """sum over pairs of (quants x) pairwise, times the int16 ``scales``, pairwise again."""
        b = self.builder
        return b.call(self._wd, [b.call(self._ubsw, [quants, x]), scales])


def _blocks(context, builder, aryty, ary, block_bytes):
    """The number of ``block_bytes`` blocks in the uint8 row ``ary``."""
    n = context.make_array(aryty)(context, builder, ary).nitems
    return builder.udiv(n, ir.Constant(n.type, block_bytes))


def _k_row_dot(fifth_bit: bool, wide: bool):
    """The Q4_K (``fifth_bit`` False, 144-byte blocks) or Q5_K (176) row-dot intrinsic: the same
    scales and mins; Q5_K's quants at byte 48 with bit j of ``qh[l]`` (32 bytes at byte 16) as
    sub-block j's 5th bit. ``wide``: 64 quants an instruction (AVX-512BW), two sub-blocks side by
    side; else 32 (AVX2)."""
    block_bytes = 176 if fifth_bit else 144

    def row_dot(typingctx, row, xq8, xd, xb):
        sig = types.float32(row, xq8, xd, xb)

        def codegen(context, builder, signature, args):
            rp, xp, dp, bp = (_data(context, builder, t, v) for t, v in zip(signature.args, args))
            madd = _Madd(builder, wide)
            quant_acc = cgutils.alloca_once_value(builder, ir.Constant(madd.f32, [0.0] * madd.lanes))
            min_acc = cgutils.alloca_once_value(builder, _const(F32, 8, 0.0))
            c = lambda v: ir.Constant(I32, v)  # noqa: E731
            with cgutils.for_range(builder, _blocks(context, builder, signature.args[0], args[0], block_bytes)) as loop:
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

                def bytes8(lo, hi, wide_ty):  # two words -> <8 x i8> -> zero-extended to <8 x wide_ty>
                    pair = ir.Constant(ir.VectorType(I32, 2), ir.Undefined)
                    pair = builder.insert_element(builder.insert_element(pair, lo, c(0)), hi, c(1))
                    return builder.zext(builder.bitcast(pair, V8I8), ir.VectorType(wide_ty, 8))

                scales = bytes8(s03, s47, I16)
                mins = bytes8(m03, m47, I32)
                q = _at(builder, o, 48 if fifth_bit else 16)
                qh = _load(builder, rp, _at(builder, o, 16), V32I8) if fifth_bit else None

                def quants(nib, sub):  # <32 x i8> nibbles of sub-block ``sub``, with Q5_K's 5th bit
                    if fifth_bit:
                        bit = builder.and_(builder.lshr(qh, _const(I8, 32, sub)), _const(I8, 32, 1))
                        nib = builder.or_(nib, builder.shl(bit, _const(I8, 32, 4)))
                    return nib

                def x32(sub):
                    return _load(builder, xp, _at(builder, x0, 32 * sub), V32I8)

                acc = ir.Constant(madd.i32, [0] * madd.lanes)
                # 32 bytes at q + 32 g: low nibbles are sub-block 2g, high nibbles 2g + 1
                if wide:  # bytes of groups g and g + 1 side by side: sub-blocks (2g, 2g + 2) | (2g + 1, 2g + 3)
                    for g in (0, 2):
                        w = _load(builder, rp, _at(builder, q, 32 * g), ir.VectorType(I8, 64))
                        for nib, subs in ((builder.and_(w, _const(I8, 64, 15)), (2 * g, 2 * g + 2)),
                                          (builder.lshr(w, _const(I8, 64, 4)), (2 * g + 1, 2 * g + 3))):
                            if fifth_bit:
                                hb = _cat(builder, *(quants(_const(I8, 32, 0), sub) for sub in subs))
                                nib = builder.or_(nib, hb)
                            x = _cat(builder, x32(subs[0]), x32(subs[1]))
                            acc = builder.add(acc, madd(nib, x, _lanes(builder, scales, [subs[0]] * 16 + [subs[1]] * 16)))
                else:
                    for g in range(4):
                        w = _load(builder, rp, _at(builder, q, 32 * g), V32I8)
                        for nib, sub in ((builder.and_(w, _const(I8, 32, 15)), 2 * g),
                                         (builder.lshr(w, _const(I8, 32, 4)), 2 * g + 1)):
                            acc = builder.add(acc, madd(quants(nib, sub), x32(sub), _lanes(builder, scales, [sub] * 16)))
                min_ints = builder.mul(mins, _load(builder, bp, builder.mul(b, ir.Constant(b.type, 8)), V8I32))
                xdb = builder.load(builder.gep(dp, [b]))
                for ints, byte, ptr in ((acc, 0, quant_acc), (min_ints, 2, min_acc)):  # d, then dmin
                    _accumulate(builder, ptr, ints, builder.fmul(xdb, _half(builder, rp, _at(builder, o, byte))))
            return builder.fsub(_reduce(builder, builder.load(quant_acc)), _reduce(builder, builder.load(min_acc)))

        return sig, codegen

    row_dot.__name__ = ("q5k" if fifth_bit else "q4k") + ("_row_dot_wide" if wide else "_row_dot")
    return intrinsic(row_dot)


def _q6k_row_dot(wide: bool):
    """The Q6_K row-dot intrinsic; ``wide`` as in :func:`_k_row_dot`."""

    def row_dot(typingctx, row, xq8, xd, x16):
        sig = types.float32(row, xq8, xd, x16)

        def codegen(context, builder, signature, args):
            rp, xp, dp, sp = (_data(context, builder, t, v) for t, v in zip(signature.args, args))
            madd = _Madd(builder, wide)
            quant_acc = cgutils.alloca_once_value(builder, ir.Constant(madd.f32, [0.0] * madd.lanes))
            with cgutils.for_range(builder, _blocks(context, builder, signature.args[0], args[0], 210)) as loop:
                b = loop.index
                o = builder.mul(b, ir.Constant(b.type, 210))
                x0 = builder.mul(b, ir.Constant(b.type, 256))
                scales = builder.sext(_load(builder, rp, _at(builder, o, 192), V16I8), V16I16)  # 16 int8 scales
                acc = ir.Constant(madd.i32, [0] * madd.lanes)
                for h in range(2):  # two halves of 128: ql 64 bytes, qh 32 bytes each
                    l0 = _load(builder, rp, _at(builder, o, 64 * h), V32I8)
                    l1 = _load(builder, rp, _at(builder, o, 64 * h + 32), V32I8)
                    hb = _load(builder, rp, _at(builder, o, 128 + 32 * h), V32I8)
                    quants = []  # 0..63, the stored q + 32, of elements 128 h + 32 g ...
                    for g, low in enumerate((builder.and_(l0, _const(I8, 32, 15)), builder.and_(l1, _const(I8, 32, 15)),
                                             builder.lshr(l0, _const(I8, 32, 4)), builder.lshr(l1, _const(I8, 32, 4)))):
                        high = builder.and_(builder.lshr(hb, _const(I8, 32, 2 * g)), _const(I8, 32, 3))
                        quants.append(builder.or_(low, builder.shl(high, _const(I8, 32, 4))))
                    step = 2 if wide else 1  # 32-quant groups an instruction
                    for g in range(0, 4, step):
                        x = _load(builder, xp, _at(builder, x0, 128 * h + 32 * g), ir.VectorType(I8, 32 * step))
                        quant = _cat(builder, quants[g], quants[g + 1]) if wide else quants[g]
                        k = 8 * h + 2 * g  # each 16 elements take the next scale
                        picks = [k + i // 8 for i in range(16 * step)]
                        acc = builder.add(acc, madd(quant, x, _lanes(builder, scales, picks)))
                # minus 32 sum_k c_k (sum of x over the 16 of sub-block k)
                sums = _load(builder, sp, builder.mul(b, ir.Constant(b.type, 16)), V16I16)
                corr = builder.shl(builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, V16I16, V16I16),
                                                [scales, sums]), _const(I32, 8, 5))
                if wide:
                    corr = _cat(builder, corr, ir.Constant(V8I32, [0] * 8))
                acc = builder.sub(acc, corr)
                _accumulate(builder, quant_acc, acc,
                            builder.fmul(builder.load(builder.gep(dp, [b])), _half(builder, rp, _at(builder, o, 208))))
            return _reduce(builder, builder.load(quant_acc))

        return sig, codegen

    row_dot.__name__ = "q6k_row_dot_wide" if wide else "q6k_row_dot"
    return intrinsic(row_dot)


q4k_row_dot, q5k_row_dot, q6k_row_dot = _k_row_dot(False, False), _k_row_dot(True, False), _q6k_row_dot(False)
q4k_row_dot_wide, q5k_row_dot_wide, q6k_row_dot_wide = _k_row_dot(False, True), _k_row_dot(True, True), _q6k_row_dot(True)


@intrinsic
def prefetch(typingctx, row, start, stop):
    """Ask for bytes ``[start, stop)`` of the uint8 array ``row`` to be brought into the cache
    (one ``llvm.prefetch`` a 64-byte line: read, keep in all levels). Changes no value; a hint
    for the rows a thread will read next, which the hardware's stream prefetchers start late on
    (each 4 KiB page anew, each short run of rows anew)."""
    def codegen(context, builder, sig, args):
        ary, start_, stop_ = args
        ptr = _data(context, builder, sig.args[0], ary)
        opaque = getattr(ptr.type, "is_opaque", False)
        name = "llvm.prefetch.p0" if opaque else "llvm.prefetch.p0i8"
        fn = _fn(builder, name, ir.VoidType(), ptr.type, I32, I32, I32)
        step = ir.Constant(start_.type, 64)
        with cgutils.for_range_slice(builder, start_, stop_, step, inc=True) as (i, _):
            builder.call(fn, [builder.gep(ptr, [i]), ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])
        return context.get_dummy_value()

    return types.void(row, start, stop), codegen
