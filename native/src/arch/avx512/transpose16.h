// The 16 x 16 dword transposition of AVX-512 kernels that turn 16 weight rows into vector
// lanes (the VNNI small-pass int4 GEMM; the AMX weight layout can use it too).  Include
// only from translation units compiled for AVX-512 (internal linkage in each).
#pragma once

#include <immintrin.h>

namespace edgepack {
namespace infer {
namespace {

// The 16 x 16 dword transposition: v[r] lane l = A[r][l] becomes v[l] lane r = A[r][l].
inline void transpose16(__m512i (&v)[16]) {
    __m512i b[16], c[16];
    for (int r = 0; r < 16; r += 2) {
        b[r] = _mm512_unpacklo_epi32(v[r], v[r + 1]);
        b[r + 1] = _mm512_unpackhi_epi32(v[r], v[r + 1]);
    }
    for (int q = 0; q < 16; q += 4) {  // c[q + m], 128-bit lane k: dword 4k + m of rows q..q+3
        c[q] = _mm512_unpacklo_epi64(b[q], b[q + 2]);
        c[q + 1] = _mm512_unpackhi_epi64(b[q], b[q + 2]);
        c[q + 2] = _mm512_unpacklo_epi64(b[q + 1], b[q + 3]);
        c[q + 3] = _mm512_unpackhi_epi64(b[q + 1], b[q + 3]);
    }
    for (int m = 0; m < 4; ++m) {  // the 4 x 4 transposition of 128-bit lanes of c[m], c[4+m], c[8+m], c[12+m]
        const __m512i t0 = _mm512_shuffle_i32x4(c[m], c[4 + m], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i t1 = _mm512_shuffle_i32x4(c[m], c[4 + m], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i t2 = _mm512_shuffle_i32x4(c[8 + m], c[12 + m], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i t3 = _mm512_shuffle_i32x4(c[8 + m], c[12 + m], _MM_SHUFFLE(3, 2, 3, 2));
        v[m] = _mm512_shuffle_i32x4(t0, t2, _MM_SHUFFLE(2, 0, 2, 0));
        v[4 + m] = _mm512_shuffle_i32x4(t0, t2, _MM_SHUFFLE(3, 1, 3, 1));
        v[8 + m] = _mm512_shuffle_i32x4(t1, t3, _MM_SHUFFLE(2, 0, 2, 0));
        v[12 + m] = _mm512_shuffle_i32x4(t1, t3, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

}  // namespace
}  // namespace infer
}  // namespace edgepack
