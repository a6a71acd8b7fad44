// Binding helpers shared by bind_infer.cpp and the whole-layer binding (layer.cpp).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "infer.h"

namespace edgepack {
namespace infer {

// A validated weight matrix bound once: holds references to the numpy parts (e.g. views
// of a package's read-only mmap) and the raw view the kernels use.  Python: Weight.
struct __attribute__((visibility("hidden"))) Weight {
    pybind11::object codes, scales, zeros;
    WeightView view;

    Weight(const pybind11::object& codes, const pybind11::object& scales, const pybind11::object& zeros,
           const pybind11::object& encoding, int64_t group);
    int64_t nbytes() const;
};

// A validated paged KV cache (the arrays it points into are kept alive by `keep`).
struct __attribute__((visibility("hidden"))) KvHandle {
    KvCache kv;
    std::vector<pybind11::array> keep;
};

// Checks k_cache / k_scale / v_cache / v_scale (/ v_high (/ v_mins): the int6 / int5 V layouts,
// chosen by a float16 k_scale) / block_table (layout in _kernels.pyi) for
// positions [0, needed_positions); the V group is head_dim / v_scale.shape[3] (a multiple
// of 8); `rotate`: K/V stored Hadamard-rotated (layout "int8"). TypeError / ValueError on
// any mismatch.
KvHandle kv_cache_from(const pybind11::object& k_cache, const pybind11::object& k_scale,
                       const pybind11::object& v_cache, const pybind11::object& v_scale,
                       const pybind11::object& block_table, int64_t needed_positions,
                       const pybind11::object& v_high = pybind11::none(),
                       const pybind11::object& v_mins = pybind11::none(), bool rotate = false);
// kv_cache_from in two steps: the cache arrays (fixed for a pool's life; `kv.table` unset),
// then a block table for positions [0, needed_positions) checked against them (returned:
// the caller keeps it alive while `kv` points into it).
KvHandle kv_arrays_from(const pybind11::object& k_cache, const pybind11::object& k_scale,
                        const pybind11::object& v_cache, const pybind11::object& v_scale,
                        const pybind11::object& v_high, const pybind11::object& v_mins, bool rotate);
pybind11::array bind_block_table(KvCache& kv, const pybind11::object& block_table, int64_t needed_positions);

// Raises edgepack.runtime_shim.errors.NumericError for a failed kernel Result: .code is
// the Status, .op the kernel, .row / .col where; the message says `where` in words.
[[noreturn]] void raise_numeric(const Result& r, const char* op, const std::string& where);
// "token t, k head h" (or V group) of a KV-write Result over H kv heads.
std::string kv_where(const Result& r, int64_t H);

void bind_infer(pybind11::module_& m);
void bind_layer(pybind11::module_& m);  // layer.cpp

}  // namespace infer
}  // namespace edgepack
