// The "amx" quantization table: the AVX-512 kernels under the name that selects the AMX
// inference table (dispatch.cpp pairs the two by name); AMX has nothing to add here.
#include "../../kernels.h"

namespace edgepack {
namespace {

// The AMX GEMM gives the reference's bits; the decode GEMV (T = 1) stays avx512's.  A GEMM
// row equals the GEMV of its token (the runtime's batch-invariance contract: prompt lookup,
// prefix caches) only once that GEMV follows the reference order too (branch vnni-order).
// Until then "amx" is opt-in (set_isa("amx"), EDGEPACK_ISA=amx) and ranks below avx512.
constexpr bool kGemvInReferenceOrder = false;

}  // namespace

const KernelTable& amx_table() {
    static const KernelTable t = [] {
        KernelTable r = avx512_table();
        r.name = "amx";
        r.score = kGemvInReferenceOrder ? 40 : 20;
        return r;
    }();
    return t;
}

}  // namespace edgepack
