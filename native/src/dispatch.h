// Run-time ISA selection: CPU feature probe plus the one table of kernel tables.
#pragma once

#include <vector>

#include "infer/infer.h"
#include "kernels.h"

namespace edgepack {

struct CpuFeatures {
    bool sse4_1 = false, avx = false, avx2 = false, fma = false, f16c = false;
    bool avx512f = false, avx512bw = false, avx512vl = false, avx512vnni = false;
    bool os_ymm = false;  // the OS saves YMM state (XCR0), required for AVX/AVX2
    bool os_zmm = false;  // the OS saves opmask/ZMM state, required for AVX-512
    bool amx_tile = false, amx_int8 = false;
    bool os_amx = false;  // XCR0 saves tile state and the process may use it (arch_prctl)
    bool neon = false;
};

const CpuFeatures& cpu_features();

// Tables compiled in AND usable on this CPU, lowest score first ("scalar" is always there).
std::vector<const KernelTable*> usable_tables();

// Every table compiled into this build, usable or not.
std::vector<const KernelTable*> compiled_tables();

const KernelTable& active_table();
void set_active_table(const KernelTable& t);

// The inference kernel table of the same ISA as active_table(); set_active_table (and so
// the Python set_isa) switches both together.
const infer::InferTable& active_infer_table();

}  // namespace edgepack
