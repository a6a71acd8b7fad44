// Python bindings for the quantization kernels: strict argument checking, conversion of
// kernel Status codes into edgepack.format.errors.EncodingError (carrying the Status as
// .code; STATUS_CODES exports the numbering), GIL release and row-parallel execution.  Semantics and messages mirror edgepack/format/codecs.py.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "dispatch.h"
#include "infer/bind_infer.h"
#include "kernels.h"

namespace py = pybind11;
using edgepack::Result;
using edgepack::Status;

namespace {

constexpr int64_t kMinGroup = 8;
constexpr int64_t kMaxGroup = 4096;
constexpr int64_t kMinParallelElems = 1 << 15;  // below this, threads cost more than they save
constexpr int kMaxThreads = 256;

using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;

py::object& encoding_error() {
    PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> storage;
    return storage
        .call_once_and_store_result([]() {
            return py::module_::import("edgepack.format.errors").attr("EncodingError");
        })
        .get_stored();
}

// The Status numbering by name (edgepack.runtime_shim.errors.KernelStatus mirrors it).
py::dict status_codes() {
    py::dict d;
    for (const Status s : {Status::ok, Status::non_finite, Status::scale_overflow, Status::min_overflow,
                           Status::bad_shape, Status::bad_dtype}) {
        const char* name = "";
        switch (s) {
            case Status::ok: name = "ok"; break;
            case Status::non_finite: name = "non_finite"; break;
            case Status::scale_overflow: name = "scale_overflow"; break;
            case Status::min_overflow: name = "min_overflow"; break;
            case Status::bad_shape: name = "bad_shape"; break;
            case Status::bad_dtype: name = "bad_dtype"; break;
        }
        d[name] = static_cast<int32_t>(s);
    }
    return d;
}

// EncodingError(msg) with .code = the Status that stopped the kernel (bad_shape / bad_dtype
// for arguments the binding refuses).
[[noreturn]] void raise_encoding(const std::string& msg, Status code) {
    py::object err = encoding_error()(msg);
    err.attr("code") = static_cast<int32_t>(code);
    PyErr_SetObject(encoding_error().ptr(), err.ptr());
    throw py::error_already_set();
}

std::string py_str(const py::handle& h) { return py::str(h).cast<std::string>(); }

struct Matrix {
    F32Array a;
    std::vector<py::ssize_t> shape;  // original shape, for error positions
    int64_t rows = 0, cols = 0;
};

Matrix as_matrix(const py::object& w) {
    py::array arr = py::array::ensure(w);
    if (!arr) throw py::error_already_set();
    if (arr.dtype().kind() != 'f') {
        raise_encoding("cannot encode tensor of dtype " + py_str(arr.dtype()) +
                       ": a float dtype is required", Status::bad_dtype);
    }
    if (arr.ndim() < 2) {
        raise_encoding("cannot encode a " + std::to_string(arr.ndim()) +
                       "-D tensor: at least 2 dimensions needed", Status::bad_shape);
    }
    Matrix m;
    m.shape.assign(arr.shape(), arr.shape() + arr.ndim());
    if (arr.size() == 0) {
        raise_encoding("cannot encode empty tensor of shape " +
                       py_str(py::tuple(py::cast(m.shape))), Status::bad_shape);
    }
    m.a = F32Array::ensure(arr);
    if (!m.a) throw py::error_already_set();
    m.rows = m.shape[0];
    m.cols = static_cast<int64_t>(arr.size()) / m.rows;
    return m;
}

int64_t check_group(int64_t cols, int64_t g) {
    if (g < kMinGroup || g > kMaxGroup || g % 8 != 0) {
        raise_encoding("group size " + std::to_string(g) + " invalid: must be a multiple of 8 in [" +
                       std::to_string(kMinGroup) + ", " + std::to_string(kMaxGroup) + "]", Status::bad_shape);
    }
    if (cols % g != 0) {
        raise_encoding("row length " + std::to_string(cols) + " is not a multiple of the group size " +
                       std::to_string(g), Status::bad_shape);
    }
    return g;
}

int check_threads(int threads) {
    if (threads < 1 || threads > kMaxThreads) {
        throw py::value_error("threads must be in [1, " + std::to_string(kMaxThreads) + "], got " +
                              std::to_string(threads));
    }
    return threads;
}

// Run fn(r0, r1) over contiguous row blocks, one per thread; the calling thread takes the
// last block.  Results are combined in row order, so errors and outputs do not depend on
// the thread count.  Must be called with the GIL released.
template <class Fn>
Result run_rows(int64_t rows, int64_t cols, int threads, const Fn& fn) {
    if (rows <= 0 || cols <= 0) return {};
    int64_t n = std::min<int64_t>(threads, rows);
    if (rows * cols < kMinParallelElems) n = 1;
    const int64_t chunk = (rows + n - 1) / n;
    n = (rows + chunk - 1) / chunk;
    std::vector<Result> results(static_cast<size_t>(n));
    auto work = [&](int64_t t) {
        const int64_t r0 = t * chunk;
        Result res = fn(r0, std::min(rows, r0 + chunk));
        res.row += r0;
        results[static_cast<size_t>(t)] = res;
    };
    std::vector<std::thread> pool;
    int64_t spawned = 0;
    try {
        for (; spawned < n - 1; ++spawned) pool.emplace_back(work, spawned);
    } catch (const std::exception&) {
        // Could not start a thread: do the remaining blocks here.
    }
    for (int64_t t = spawned; t < n; ++t) work(t);
    for (std::thread& th : pool) th.join();
    for (const Result& res : results) {
        if (res.status != Status::ok) return res;
    }
    return {};
}

std::string format_value(float v) {
    if (std::isnan(v)) return "nan";
    return v > 0 ? "inf" : "-inf";
}

[[noreturn]] void raise_status(const Result& res, const Matrix& m) {
    if (res.status == Status::non_finite) {
        int64_t flat = res.row * m.cols + res.col;
        const float v = m.a.data()[flat];
        std::vector<int64_t> idx(m.shape.size());
        for (size_t k = m.shape.size(); k-- > 0;) {
            idx[k] = flat % m.shape[k];
            flat /= m.shape[k];
        }
        std::string pos = "(";
        for (size_t k = 0; k < idx.size(); ++k) pos += (k ? ", " : "") + std::to_string(idx[k]);
        raise_encoding("cannot encode tensor: non-finite value (" + format_value(v) +
                       ") at index " + pos + ")", res.status);
    }
    const char* what = res.status == Status::min_overflow ? "min" : "scale";
    raise_encoding(std::string("cannot encode tensor: float16 ") + what + " overflows in row " +
                   std::to_string(res.row) + ", group " + std::to_string(res.col) +
                   " (weights too large for int4)", res.status);
}

py::array float16_array(int64_t rows, int64_t cols) {
    return py::array(py::dtype("float16"), std::vector<py::ssize_t>{rows, cols});
}

bool is_f16(const py::array& a) { return a.dtype().kind() == 'f' && a.dtype().itemsize() == 2; }

std::string describe(const py::array& a) {
    return py_str(a.dtype()) + " " + py_str(py::tuple(py::cast(std::vector<py::ssize_t>(
                                            a.shape(), a.shape() + a.ndim()))));
}

std::string shape_str(int64_t a) { return "(" + std::to_string(a) + ",)"; }
std::string shape_str(int64_t a, int64_t b) {
    return "(" + std::to_string(a) + ", " + std::to_string(b) + ")";
}

template <class T>
py::array_t<T, py::array::c_style> contiguous(const py::array& a) {
    auto c = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(a);
    if (!c) throw py::error_already_set();
    return c;
}

py::array_t<float, py::array::c_style> output(const py::object& out, int64_t rows, int64_t cols) {
    if (out.is_none()) return py::array_t<float, py::array::c_style>({rows, cols});
    if (!py::isinstance<py::array>(out)) throw py::type_error("out must be a numpy array");
    py::array o = out.cast<py::array>();
    const bool ok = o.dtype().is(py::dtype::of<float>()) && o.ndim() == 2 && o.shape(0) == rows &&
                    o.shape(1) == cols && (o.flags() & py::array::c_style) && o.writeable();
    if (!ok) {
        throw py::value_error("out must be a writeable C-contiguous float32 array of shape " +
                              shape_str(rows, cols) + ", got " + describe(o));
    }
    return o.cast<py::array_t<float, py::array::c_style>>();
}

py::tuple quantize_int8_channel(const py::object& w, int threads) {
    check_threads(threads);
    Matrix m = as_matrix(w);
    py::array_t<int8_t> codes({m.rows, m.cols});
    py::array_t<float> scales(m.rows);
    const float* src = m.a.data();
    int8_t* q = codes.mutable_data();
    float* s = scales.mutable_data();
    const int64_t C = m.cols;
    Result res;
    {
        py::gil_scoped_release nogil;
        const auto fn = edgepack::active_table().quantize_i8;
        res = run_rows(m.rows, C, threads, [&](int64_t r0, int64_t r1) {
            return fn({src + r0 * C, r1 - r0, C, q + r0 * C, s + r0});
        });
    }
    if (res.status != Status::ok) raise_status(res, m);
    return py::make_tuple(codes, scales);
}

py::array dequantize_int8_channel(const py::array& codes_in, const py::array& scales_in,
                                  const py::object& out, int threads) {
    check_threads(threads);
    if (codes_in.dtype().kind() != 'i' || codes_in.dtype().itemsize() != 1 || codes_in.ndim() != 2) {
        raise_encoding("int8 codes must be a 2-D int8 array, got " + describe(codes_in), Status::bad_dtype);
    }
    const int64_t R = codes_in.shape(0), C = codes_in.shape(1);
    if (!scales_in.dtype().is(py::dtype::of<float>()) || scales_in.ndim() != 1 ||
        scales_in.shape(0) != R) {
        raise_encoding("int8 scales must be float32 of shape " + shape_str(R) + ", got " +
                       describe(scales_in), Status::bad_shape);
    }
    auto codes = contiguous<int8_t>(codes_in);
    auto scales = contiguous<float>(scales_in);
    auto result = output(out, R, C);
    const int8_t* q = codes.data();
    const float* s = scales.data();
    float* o = result.mutable_data();
    {
        py::gil_scoped_release nogil;
        const auto fn = edgepack::active_table().dequantize_i8;
        run_rows(R, C, threads, [&](int64_t r0, int64_t r1) {
            fn({q + r0 * C, s + r0, r1 - r0, C, o + r0 * C});
            return Result{};
        });
    }
    return result;
}

py::tuple quantize_int4_group(const py::object& w, int64_t group_size, bool symmetric,
                              int threads) {
    check_threads(threads);
    Matrix m = as_matrix(w);
    const int64_t C = m.cols, g = check_group(C, group_size), G = C / g;
    py::array_t<uint8_t> codes({m.rows, C / 2});
    py::array scales = float16_array(m.rows, G);
    py::object mins_obj = py::none();
    uint16_t* mn = nullptr;
    if (!symmetric) {
        py::array mins = float16_array(m.rows, G);
        mn = static_cast<uint16_t*>(mins.mutable_data());
        mins_obj = mins;
    }
    const float* src = m.a.data();
    uint8_t* q = codes.mutable_data();
    auto* s = static_cast<uint16_t*>(scales.mutable_data());
    Result res;
    {
        py::gil_scoped_release nogil;
        const auto& table = edgepack::active_table();
        const auto fn = symmetric ? table.quantize_i4_sym : table.quantize_i4_asym;
        res = run_rows(m.rows, C, threads, [&](int64_t r0, int64_t r1) {
            return fn({src + r0 * C, r1 - r0, C, g, q + r0 * (C / 2), s + r0 * G,
                       mn ? mn + r0 * G : nullptr});
        });
    }
    if (res.status != Status::ok) raise_status(res, m);
    return py::make_tuple(codes, scales, mins_obj);
}

py::array dequantize_int4_group(const py::array& codes_in, const py::array& scales_in,
                                const py::object& mins_in, int64_t group_size,
                                const py::object& out, int threads) {
    check_threads(threads);
    if (!codes_in.dtype().is(py::dtype::of<uint8_t>()) || codes_in.ndim() != 2) {
        raise_encoding("int4 codes must be a 2-D uint8 array, got " + describe(codes_in), Status::bad_dtype);
    }
    const int64_t R = codes_in.shape(0), C = codes_in.shape(1) * 2;
    const int64_t g = check_group(C, group_size), G = C / g;
    if (!is_f16(scales_in) || scales_in.ndim() != 2 || scales_in.shape(0) != R ||
        scales_in.shape(1) != G) {
        raise_encoding("int4 scales must be float16 of shape " + shape_str(R, G) + ", got " +
                       describe(scales_in), Status::bad_shape);
    }
    const bool has_mins = !mins_in.is_none();
    py::array mins_arr;  // note: a default py::array is an empty array, not a null handle
    if (has_mins) {
        mins_arr = py::array::ensure(mins_in);
        if (!mins_arr) throw py::error_already_set();
        if (!is_f16(mins_arr) || mins_arr.ndim() != 2 || mins_arr.shape(0) != R ||
            mins_arr.shape(1) != G) {
            raise_encoding("int4 mins must be float16 of shape " + shape_str(R, G) + ", got " +
                           describe(mins_arr), Status::bad_shape);
        }
    }
    auto codes = contiguous<uint8_t>(codes_in);
    auto scales = contiguous<uint16_t>(py::array(scales_in).view("uint16"));
    py::array_t<uint16_t, py::array::c_style> mins;
    if (has_mins) mins = contiguous<uint16_t>(mins_arr.view("uint16"));
    auto result = output(out, R, C);
    const uint8_t* q = codes.data();
    const uint16_t* s = scales.data();
    const uint16_t* mn = has_mins ? mins.data() : nullptr;
    float* o = result.mutable_data();
    {
        py::gil_scoped_release nogil;
        const auto fn = edgepack::active_table().dequantize_i4;
        run_rows(R, C, threads, [&](int64_t r0, int64_t r1) {
            fn({q + r0 * (C / 2), s + r0 * G, mn ? mn + r0 * G : nullptr, r1 - r0, C, g,
                o + r0 * C});
            return Result{};
        });
    }
    return result;
}

py::dict cpu_features() {
    const edgepack::CpuFeatures& f = edgepack::cpu_features();
    py::dict d;
    d["sse4_1"] = f.sse4_1;
    d["avx"] = f.avx;
    d["avx2"] = f.avx2;
    d["fma"] = f.fma;
    d["f16c"] = f.f16c;
    d["avx512f"] = f.avx512f;
    d["avx512bw"] = f.avx512bw;
    d["avx512vl"] = f.avx512vl;
    d["avx512vnni"] = f.avx512vnni;
    d["os_ymm"] = f.os_ymm;
    d["os_zmm"] = f.os_zmm;
    d["amx_tile"] = f.amx_tile;
    d["amx_int8"] = f.amx_int8;
    d["os_amx"] = f.os_amx;
    d["neon"] = f.neon;
    return d;
}

std::vector<std::string> available_isas() {
    std::vector<std::string> names;
    for (const auto* t : edgepack::usable_tables()) names.emplace_back(t->name);
    return names;
}

void set_isa(const std::string& name) {
    for (const auto* t : edgepack::usable_tables()) {
        if (name == t->name) {
            edgepack::set_active_table(*t);
            return;
        }
    }
    std::string known;
    for (const auto* t : edgepack::compiled_tables()) known += std::string(known.empty() ? "" : ", ") + t->name;
    throw py::value_error("ISA '" + name + "' is not usable on this CPU/build (compiled: " + known +
                          "; usable: " + py_str(py::cast(available_isas())) + ")");
}

}  // namespace

PYBIND11_MODULE(_kernels, m) {
    m.doc() = "edgepack native quantization kernels (bit-identical to edgepack.format.codecs)";
    encoding_error();  // import the exception class now so a broken install fails early
    m.attr("STATUS_CODES") = status_codes();

    m.def("quantize_int8_channel", &quantize_int8_channel, py::arg("w"), py::kw_only(),
          py::arg("threads") = 2, "Symmetric int8 per row: returns (codes int8[R, C], scales f32[R]).");
    m.def("dequantize_int8_channel", &dequantize_int8_channel, py::arg("codes"), py::arg("scales"),
          py::kw_only(), py::arg("out") = py::none(), py::arg("threads") = 2,
          "codes * scales[:, None] as float32 [R, C].");
    m.def("quantize_int4_group", &quantize_int4_group, py::arg("w"), py::arg("group_size"),
          py::arg("symmetric"), py::kw_only(), py::arg("threads") = 2,
          "Group-wise int4: returns (codes u8[R, C/2], scales f16[R, C/g], mins f16[R, C/g] | None).");
    m.def("dequantize_int4_group", &dequantize_int4_group, py::arg("codes"), py::arg("scales"),
          py::arg("mins"), py::arg("group_size"), py::kw_only(), py::arg("out") = py::none(),
          py::arg("threads") = 2, "Inverse of quantize_int4_group: float32 [R, C].");
    m.def("cpu_features", &cpu_features, "CPU/OS features relevant to kernel selection.");
    m.def("available_isas", &available_isas, "Kernel sets usable here, lowest priority first.");
    m.def("active_isa", []() { return std::string(edgepack::active_table().name); },
          "Name of the kernel set in use.");
    m.def("set_isa", &set_isa, py::arg("name"),
          "Force a kernel set ('scalar', 'avx2', 'avx512', 'amx', 'neon'); ValueError if not usable.");

    // Inference kernels (infer/bind_infer.cpp); set_isa above switches them too.
    edgepack::infer::bind_infer(m);

    // EDGEPACK_ISA=<name> replaces the default pick (e.g. avx512 vs amx side by side); a
    // name not usable here fails the import (pybind11 turns set_isa's ValueError into an
    // ImportError with the same message).
    if (const char* isa = std::getenv("EDGEPACK_ISA"); isa != nullptr && *isa != '\0') set_isa(isa);
}
