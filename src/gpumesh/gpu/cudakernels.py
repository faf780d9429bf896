"""The kernels GPUMesh ships: hand-written PTX at a low ISA version.

PTX ISA 6.0 for ``sm_50`` is accepted by every driver since CUDA 9, so the demo
runs on old drivers too (NVRTC from PyPI would emit a newer ISA that they
refuse). The host-memory fallback runs these by entry name
(:mod:`gpumesh.gpu.cudafallback`), so the same demo runs with or without a GPU.
"""

from __future__ import annotations

__all__ = ["VADD_F32", "VADD_PTX"]

VADD_F32 = "gpumesh_vadd_f32"
"""``c[i] = a[i] + b[i]`` for ``i < n``; arguments ``(ptr a, ptr b, ptr c, u32 n)``,
one thread per element along x."""

VADD_PTX = """\
.version 6.0
.target sm_50
.address_size 64

.visible .entry gpumesh_vadd_f32(
\t.param .u64 gpumesh_vadd_f32_a,
\t.param .u64 gpumesh_vadd_f32_b,
\t.param .u64 gpumesh_vadd_f32_c,
\t.param .u32 gpumesh_vadd_f32_n
)
{
\t.reg .pred \t%p<2>;
\t.reg .b32 \t%r<6>;
\t.reg .f32 \t%f<4>;
\t.reg .b64 \t%rd<11>;

\tld.param.u64 \t%rd1, [gpumesh_vadd_f32_a];
\tld.param.u64 \t%rd2, [gpumesh_vadd_f32_b];
\tld.param.u64 \t%rd3, [gpumesh_vadd_f32_c];
\tld.param.u32 \t%r2, [gpumesh_vadd_f32_n];
\tmov.u32 \t%r3, %ctaid.x;
\tmov.u32 \t%r4, %ntid.x;
\tmov.u32 \t%r5, %tid.x;
\tmad.lo.s32 \t%r1, %r3, %r4, %r5;
\tsetp.ge.u32 \t%p1, %r1, %r2;
\t@%p1 bra \tDONE;
\tcvta.to.global.u64 \t%rd4, %rd1;
\tcvta.to.global.u64 \t%rd5, %rd2;
\tcvta.to.global.u64 \t%rd6, %rd3;
\tmul.wide.u32 \t%rd7, %r1, 4;
\tadd.s64 \t%rd8, %rd4, %rd7;
\tadd.s64 \t%rd9, %rd5, %rd7;
\tadd.s64 \t%rd10, %rd6, %rd7;
\tld.global.f32 \t%f1, [%rd8];
\tld.global.f32 \t%f2, [%rd9];
\tadd.f32 \t%f3, %f1, %f2;
\tst.global.f32 \t[%rd10], %f3;
DONE:
\tret;
}
"""
