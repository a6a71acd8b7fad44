// The "amx" quantization table: the AVX-512 kernels under the name that selects the AMX
// inference table (dispatch.cpp pairs the two by name); AMX has nothing to add here.
#include "../../kernels.h"

namespace edgepack {

const KernelTable& amx_table() {
    static const KernelTable t = [] {
        KernelTable r = avx512_table();
        r.name = "amx";
        // above avx512: its GEMM (the AMX tiles) and GEMV (avx512's) both give the
        // reference's bits, so a batch row equals the GEMV of its token
        r.score = 40;
        return r;
    }();
    return t;
}

}  // namespace edgepack
