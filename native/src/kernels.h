// Kernel interface shared by the reference and every ISA override.
//
// A kernel works on a contiguous block of rows of a C-contiguous [rows, cols] matrix and
// never allocates, throws or touches Python; the binding layer validates shapes, splits
// rows across threads and turns a Status into a Python exception.  Every override must
// produce output bit-identical to the reference (ref/quant_ref.cpp), which in turn is
// bit-identical to edgepack/format/codecs.py.
#pragma once

#include <cstdint>

namespace edgepack {

// Why a kernel stopped.  Stable numbering: the Python layer maps these to EncodingError.
enum class Status : int32_t {
    ok = 0,
    non_finite = 1,      // NaN/Inf in the input; `row`/`col` locate the first one
    scale_overflow = 2,  // a float16 scale does not fit; `row`/`col` = row, group
    min_overflow = 3,    // a float16 min does not fit; `row`/`col` = row, group
    bad_shape = 4,       // raised by the binding layer only
    bad_dtype = 5,       // raised by the binding layer only
};

struct Result {
    Status status = Status::ok;
    int64_t row = 0;  // relative to the block the kernel was given
    int64_t col = 0;
};

// Row block of a quantize/dequantize call; pointers are already offset to the first row.
struct QuantI8Args {
    const float* w;
    int64_t rows, cols;
    int8_t* codes;  // [rows, cols]
    float* scales;  // [rows]
};

struct DequantI8Args {
    const int8_t* codes;
    const float* scales;
    int64_t rows, cols;
    float* out;
};

struct QuantI4Args {
    const float* w;
    int64_t rows, cols, group;
    uint8_t* codes;    // [rows, cols / 2]
    uint16_t* scales;  // float16 bits, [rows, cols / group]
    uint16_t* mins;    // float16 bits, [rows, cols / group]; unused when symmetric
};

struct DequantI4Args {
    const uint8_t* codes;
    const uint16_t* scales;
    const uint16_t* mins;  // nullptr for the symmetric form
    int64_t rows, cols, group;
    float* out;
};

using QuantI8Fn = Result (*)(const QuantI8Args&);
using DequantI8Fn = void (*)(const DequantI8Args&);
using QuantI4Fn = Result (*)(const QuantI4Args&);
using DequantI4Fn = void (*)(const DequantI4Args&);

// The one dispatch table: every entry is filled (overrides fall back to the reference).
struct KernelTable {
    const char* name;
    int score;  // higher wins when picking the default at import time
    QuantI8Fn quantize_i8;
    DequantI8Fn dequantize_i8;
    QuantI4Fn quantize_i4_sym;
    QuantI4Fn quantize_i4_asym;
    DequantI4Fn dequantize_i4;
};

// Portable reference kernels (ref/quant_ref.cpp), also used by overrides for odd rows.
namespace ref {
Result quantize_i8(const QuantI8Args& a);
void dequantize_i8(const DequantI8Args& a);
Result quantize_i4_sym(const QuantI4Args& a);
Result quantize_i4_asym(const QuantI4Args& a);
void dequantize_i4(const DequantI4Args& a);
// One int8 row, exactly as the reference does it (used for rows whose 1/d overflows).
void quantize_i8_row(const float* w, int64_t cols, float inv, int8_t* codes);
}  // namespace ref

const KernelTable& scalar_table();
#if defined(EDGEPACK_HAVE_AVX2)
const KernelTable& avx2_table();
#endif
#if defined(EDGEPACK_HAVE_AVX512)
const KernelTable& avx512_table();
#endif
#if defined(EDGEPACK_HAVE_AMX)
const KernelTable& amx_table();  // the AVX-512 kernels, named for the AMX inference table
#endif
#if defined(EDGEPACK_HAVE_NEON)
const KernelTable& neon_table();
#endif

}  // namespace edgepack
