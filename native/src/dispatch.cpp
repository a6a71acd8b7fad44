// CPU feature detection (cpuid + xgetbv on x86, so AVX-512 is only picked when the OS
// saves ZMM state) and the process-wide active kernel table.
#include "dispatch.h"

#include <atomic>
#include <string_view>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace edgepack {
namespace {

#if defined(__x86_64__) || defined(_M_X64)
uint64_t xgetbv0() {
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (static_cast<uint64_t>(hi) << 32) | lo;
}

// Linux hands out the 8 KiB AMX tile state only to processes that ask for it; the
// permission is process-wide, so asking once here covers every thread.
bool request_tile_data() {
#if defined(__linux__) && defined(__x86_64__)
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
}
#endif

CpuFeatures probe() {
    CpuFeatures f;
#if defined(__x86_64__) || defined(_M_X64)
    unsigned a = 0, b = 0, c = 0, d = 0;
    uint64_t xcr0 = 0;
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        f.sse4_1 = c & (1u << 19);
        f.fma = c & (1u << 12);
        f.avx = c & (1u << 28);
        f.f16c = c & (1u << 29);
        if (c & (1u << 27)) {  // OSXSAVE: xgetbv is available
            xcr0 = xgetbv0();
            f.os_ymm = (xcr0 & 0x6u) == 0x6u;     // SSE + AVX state
            f.os_zmm = (xcr0 & 0xe6u) == 0xe6u;   // + opmask, ZMM_Hi256, Hi16_ZMM
        }
    }
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        f.avx2 = b & (1u << 5);
        f.avx512f = b & (1u << 16);
        f.avx512bw = b & (1u << 30);
        f.avx512vl = b & (1u << 31);
        f.avx512vnni = c & (1u << 11);
        f.amx_tile = d & (1u << 24);
        f.amx_int8 = d & (1u << 25);
    }
    // XTILECFG and XTILEDATA state enabled by the OS, then the per-process permission.
    f.os_amx = f.amx_tile && f.amx_int8 && (xcr0 & 0x60000u) == 0x60000u && request_tile_data();
#elif defined(__aarch64__)
    f.neon = true;  // Advanced SIMD is mandatory on AArch64
#endif
    return f;
}

bool usable(const KernelTable& t) {
    const CpuFeatures& f = cpu_features();
    const std::string_view name = t.name;
    if (name == "avx2") return f.os_ymm && f.avx && f.avx2 && f.fma && f.f16c && f.sse4_1;
    const bool avx512 = f.os_ymm && f.os_zmm && f.avx2 && f.fma && f.f16c && f.avx512f && f.avx512bw &&
                        f.avx512vl && f.avx512vnni;
    if (name == "avx512") return avx512;
    if (name == "amx") return avx512 && f.os_amx;  // (os_amx: AMX-TILE, AMX-INT8, OS and permission)
    if (name == "neon") return f.neon;
    return true;
}

const KernelTable& best() {
    const KernelTable* pick = &scalar_table();
    for (const KernelTable* t : usable_tables()) {
        if (t->score > pick->score) pick = t;
    }
    return *pick;
}

std::atomic<const KernelTable*>& active_slot() {
    static std::atomic<const KernelTable*> slot{&best()};
    return slot;
}

// The inference table compiled for the same ISA as a quantization table.
const infer::InferTable& infer_for(const KernelTable& t) {
    const std::string_view name = t.name;
#if defined(EDGEPACK_HAVE_AVX2)
    if (name == "avx2") return infer::avx2_infer_table();
#endif
#if defined(EDGEPACK_HAVE_AVX512)
    if (name == "avx512") return infer::avx512_infer_table();
#endif
#if defined(EDGEPACK_HAVE_AMX)
    if (name == "amx") return infer::amx_infer_table();
#endif
#if defined(EDGEPACK_HAVE_NEON)
    if (name == "neon") return infer::neon_infer_table();
#endif
    (void)name;
    return infer::scalar_infer_table();
}

std::atomic<const infer::InferTable*>& infer_slot() {
    static std::atomic<const infer::InferTable*> slot{&infer_for(*active_slot().load())};
    return slot;
}

}  // namespace

const CpuFeatures& cpu_features() {
    static const CpuFeatures f = probe();
    return f;
}

std::vector<const KernelTable*> compiled_tables() {
    std::vector<const KernelTable*> all = {&scalar_table()};
#if defined(EDGEPACK_HAVE_AVX2)
    all.push_back(&avx2_table());
#endif
#if defined(EDGEPACK_HAVE_AVX512)
    all.push_back(&avx512_table());
#endif
#if defined(EDGEPACK_HAVE_AMX)
    all.push_back(&amx_table());
#endif
#if defined(EDGEPACK_HAVE_NEON)
    all.push_back(&neon_table());
#endif
    return all;
}

std::vector<const KernelTable*> usable_tables() {
    std::vector<const KernelTable*> out;
    for (const KernelTable* t : compiled_tables()) {
        if (usable(*t)) out.push_back(t);
    }
    return out;
}

const KernelTable& active_table() { return *active_slot().load(std::memory_order_acquire); }

void set_active_table(const KernelTable& t) {
    active_slot().store(&t, std::memory_order_release);
    infer_slot().store(&infer_for(t), std::memory_order_release);
}

const infer::InferTable& active_infer_table() {
    return *infer_slot().load(std::memory_order_acquire);
}

}  // namespace edgepack
