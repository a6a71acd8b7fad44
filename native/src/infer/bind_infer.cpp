// Python bindings of the inference kernels (see native/_kernels.pyi for the API contract).
//
// Every argument is checked before any kernel runs: a wrong dtype is a TypeError, a wrong
// shape, layout or value a ValueError, so no input can make a kernel read or write out of
// bounds.  NaN/Inf met while quantizing (activations, KV cache) raise
// edgepack.runtime_shim.errors.NumericError (an EdgepackError and a FloatingPointError)
// carrying the kernel's Status as .code, and .op, .row, .col; the runtime catches it to
// recompute the layer on its float path.  The GIL is released around all
// kernel work.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstring>
#include <cstdint>
#include <string>
#include <vector>

#include "../threadpool.h"
#include "bind_infer.h"
#include "ops.h"

namespace py = pybind11;

namespace edgepack {
namespace infer {
namespace {

using Shape = std::vector<py::ssize_t>;


// ---- errors -----------------------------------------------------------------------------

py::object& numeric_error() {
    PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> storage;
    return storage
        .call_once_and_store_result(
            []() { return py::module_::import("edgepack.runtime_shim.errors").attr("NumericError"); })
        .get_stored();
}

}  // namespace

[[noreturn]] void raise_numeric(const Result& r, const char* op, const std::string& where) {
    const std::string msg = std::string(op) + ": " +
                            (r.status == Status::scale_overflow ? "float16 scale overflow" : "non-finite value") +
                            " at " + where;
    py::object err = numeric_error()(msg, static_cast<int32_t>(r.status), op, r.row, r.col);
    PyErr_SetObject(numeric_error().ptr(), err.ptr());
    throw py::error_already_set();
}

std::string kv_where(const Result& r, int64_t H) {
    if (r.status == Status::scale_overflow) {
        return "token " + std::to_string(r.row) + ", V group " + std::to_string(r.col);
    }
    const bool is_v = r.col >= H;
    return "token " + std::to_string(r.row) + ", " + (is_v ? "v" : "k") + " head " + std::to_string(is_v ? r.col - H : r.col);
}

namespace {

std::string str(const py::handle& h) { return py::str(h).cast<std::string>(); }

std::string shape_of(const py::array& a) {
    std::string s = "(";
    for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
    return s + (a.ndim() == 1 ? ",)" : ")");
}

std::string shape_str(const Shape& sh) {
    std::string s = "(";
    for (size_t i = 0; i < sh.size(); ++i) s += (i ? ", " : "") + std::to_string(sh[i]);
    return s + (sh.size() == 1 ? ",)" : ")");
}

[[noreturn]] void value_error(const std::string& m) { throw py::value_error(m); }
[[noreturn]] void type_error(const std::string& m) { throw py::type_error(m); }

// ---- array checks -----------------------------------------------------------------------

py::array as_array(const py::handle& h, const char* name) {
    if (!py::isinstance<py::array>(h)) {
        type_error(std::string(name) + " must be a numpy array, got " + str(py::type::of(h)));
    }
    return py::reinterpret_borrow<py::array>(h);
}

// dtype check without building a dtype object from a string (this runs ~30 times per
// decoder_layer call): kind + item size + native byte order.
bool is(const py::array& a, const char* dt) {
    char kind = 0;
    int size = 0;
    if (std::strcmp(dt, "float32") == 0) kind = 'f', size = 4;
    else if (std::strcmp(dt, "float16") == 0) kind = 'f', size = 2;
    else if (std::strcmp(dt, "int8") == 0) kind = 'i', size = 1;
    else if (std::strcmp(dt, "uint8") == 0) kind = 'u', size = 1;
    else if (std::strcmp(dt, "uint16") == 0) kind = 'u', size = 2;
    else if (std::strcmp(dt, "int32") == 0) kind = 'i', size = 4;
    else return a.dtype().is(py::dtype(dt));
    const py::dtype d = a.dtype();
    return d.kind() == kind && d.itemsize() == size && d.byteorder() != '>';
}

void need_dtype(const py::array& a, const char* dt, const char* name) {
    if (!is(a, dt)) type_error(std::string(name) + " must be " + dt + ", got " + str(a.dtype()));
}

void need_shape(const py::array& a, const Shape& sh, const char* name) {
    bool ok = a.ndim() == static_cast<py::ssize_t>(sh.size());
    for (size_t i = 0; ok && i < sh.size(); ++i) ok = a.shape(static_cast<py::ssize_t>(i)) == sh[i];
    if (!ok) value_error(std::string(name) + " must have shape " + shape_str(sh) + ", got " + shape_of(a));
}

void need_ndim(const py::array& a, py::ssize_t nd, const char* name) {
    if (a.ndim() != nd) {
        value_error(std::string(name) + " must be " + std::to_string(nd) + "-D, got shape " + shape_of(a));
    }
}

void need_contig(const py::array& a, const char* name) {
    if (!(a.flags() & py::array::c_style)) value_error(std::string(name) + " must be C-contiguous");
}

void need_writeable(const py::array& a, const char* name) {
    if (!a.writeable()) value_error(std::string(name) + " must be writeable");
}

// Byte range [lo, hi) touched by an array view (conservative for odd strides).
std::pair<uintptr_t, uintptr_t> extent(const py::array& a) {
    auto lo = reinterpret_cast<uintptr_t>(a.data());
    uintptr_t hi = lo;
    if (a.size() == 0) return {lo, lo};
    for (py::ssize_t i = 0; i < a.ndim(); ++i) {
        const py::ssize_t s = a.strides(i) * (a.shape(i) - 1);
        if (s < 0) {
            lo -= static_cast<uintptr_t>(-s);
        } else {
            hi += static_cast<uintptr_t>(s);
        }
    }
    return {lo, hi + static_cast<uintptr_t>(a.itemsize())};
}

bool overlap(const py::array& a, const py::array& b) {
    const auto x = extent(a), y = extent(b);
    return x.first < y.second && y.first < x.second;
}

void need_disjoint(const py::array& out, const py::array& in, const char* oname, const char* iname) {
    if (overlap(out, in)) value_error(std::string(oname) + " must not overlap " + iname);
}

// float32 [rows, cols] with unit inner stride and any row stride >= cols (a view of a
// wider matrix is fine).  Returns the row stride in elements.
int64_t f32_rows(const py::array& a, const char* name) {
    need_dtype(a, "float32", name);
    need_ndim(a, 2, name);
    if (a.shape(1) > 1 && a.strides(1) != 4) value_error(std::string(name) + " must have unit stride along its last axis");
    if (a.strides(0) % 4 != 0 || (a.shape(0) > 1 && a.strides(0) < 4 * a.shape(1))) {
        value_error(std::string(name) + " rows must be laid out increasing and disjoint");
    }
    return a.shape(0) > 1 ? a.strides(0) / 4 : a.shape(1);
}

// float32 [T, H, D] with unit stride on D, stride D on H, any token stride (a view of a
// fused [T, (Hq + 2 Hkv) D] projection output is fine).  Returns the token stride.
int64_t f32_thd(const py::array& a, const char* name) {
    need_dtype(a, "float32", name);
    need_ndim(a, 3, name);
    const int64_t H = a.shape(1), D = a.shape(2);
    if ((D > 1 && a.strides(2) != 4) || (H > 1 && a.strides(1) != 4 * D)) {
        value_error(std::string(name) + " must be contiguous within each token ([H, D] block)");
    }
    if (a.strides(0) % 4 != 0 || (a.shape(0) > 1 && a.strides(0) < 4 * H * D)) {
        value_error(std::string(name) + " tokens must be laid out increasing and disjoint");
    }
    return a.shape(0) > 1 ? a.strides(0) / 4 : H * D;
}

py::array new_array(const char* dt, const Shape& sh) {
    if (std::strcmp(dt, "float32") == 0) return py::array(py::dtype::of<float>(), sh);
    if (std::strcmp(dt, "int8") == 0) return py::array(py::dtype::of<int8_t>(), sh);
    return py::array(py::dtype(dt), sh);
}

py::array out_array(const py::object& out, const char* dt, const Shape& sh, const char* name = "out") {
    if (out.is_none()) return new_array(dt, sh);
    py::array o = as_array(out, name);
    need_dtype(o, dt, name);
    need_shape(o, sh, name);
    need_contig(o, name);
    need_writeable(o, name);
    return o;
}

int64_t act_group(int64_t group, int64_t K, const char* what) {
    if (group == 0) return K;
    if (group < 0 || K % group != 0) {
        value_error(std::string(what) + " " + std::to_string(group) + " must be 0 (per token) or a positive divisor of " + std::to_string(K));
    }
    return group;
}

template <class T>
T* ptr(const py::array& a) {
    return static_cast<T*>(const_cast<void*>(a.data()));
}

// ---- weights ----------------------------------------------------------------------------

WEnc parse_encoding(const py::handle& e) {
    if (py::isinstance<py::str>(e)) {
        const std::string s = e.cast<std::string>();
        // numpy dtype names are accepted for the float encodings
        const std::string name = s == "float32" ? "f32" : s == "float16" ? "f16" : s == "bfloat16" ? "bf16" : s;
        for (const WEncInfo& w : kWEncs) {
            if (name == w.name) return w.enc;
        }
        value_error("unknown weight encoding '" + s + "' (" + kWEncNames + ")");
    }
    if (py::isinstance<py::int_>(e) && !py::isinstance<py::bool_>(e)) {
        const int64_t v = e.cast<int64_t>();  // edgepack.format.Encoding values
        if (const WEncInfo* w = wenc_of_id(v)) return w->enc;
        value_error("weight encoding " + std::to_string(v) + " has no matmul kernel");
    }
    type_error("weight encoding must be a str or an edgepack.format.Encoding, got " + str(py::type::of(e)));
}

const char* encoding_name(WEnc e) { return wenc_info(e).name; }

}  // namespace

// A validated, pre-bound weight matrix: keeps the arrays alive (e.g. views of a package's
// read-only mmap) and their raw pointers, so a matmul call does no per-call validation of
// the weight itself.
Weight::Weight(const py::object& codes_in, const py::object& scales_in, const py::object& zeros_in,
               const py::object& encoding, int64_t group) {
    const WEnc enc = parse_encoding(encoding);
    py::array c = as_array(codes_in, "codes");
    need_ndim(c, 2, "codes");
    need_contig(c, "codes");
    const int64_t N = c.shape(0);
    int64_t K = c.shape(1);
    if (N < 1 || K < 1) value_error("codes must not be empty, got shape " + shape_of(c));
    view.enc = enc;
    view.codes = c.data();
    const bool is_float = enc == WEnc::f32 || enc == WEnc::f16 || enc == WEnc::bf16;
    if (is_float || enc == WEnc::i8) {
        need_dtype(c, enc == WEnc::f32 ? "float32" : enc == WEnc::f16 ? "float16" : enc == WEnc::bf16 ? "uint16" : "int8", "codes");
        if (!zeros_in.is_none()) value_error(std::string(encoding_name(enc)) + " weights take no zeros");
        if (is_float) {
            if (!scales_in.is_none()) value_error(std::string(encoding_name(enc)) + " weights take no scales");
            if (group != 0) value_error("group must be 0 for float weights");
        } else {
            if (scales_in.is_none()) value_error("int8 weights need scales");
            py::array s = as_array(scales_in, "scales");
            need_dtype(s, "float32", "scales");
            need_shape(s, {N}, "scales");
            need_contig(s, "scales");
            if (group != 0 && group != K) value_error("group must be 0 for int8 (per-channel) weights");
            if (K > 65536) value_error("int8 weights support K <= 65536 (int32 accumulation), got " + std::to_string(K));
            view.scales_f32 = static_cast<const float*>(s.data());
            scales = s;
        }
        view.group = enc == WEnc::i8 ? K : 0;
    } else {
        need_dtype(c, "uint8", "codes");
        K *= 2;
        if (group < 8 || group % 8 != 0 || K % group != 0) {
            value_error("int4 group " + std::to_string(group) + " must be a multiple of 8 dividing the row length " + std::to_string(K));
        }
        const int64_t G = K / group;
        if (scales_in.is_none()) value_error("int4 weights need scales");
        py::array s = as_array(scales_in, "scales");
        need_dtype(s, "float16", "scales");
        need_shape(s, {N, G}, "scales");
        need_contig(s, "scales");
        view.scales_f16 = static_cast<const uint16_t*>(s.data());
        scales = s;
        if (enc == WEnc::i4asym) {
            if (zeros_in.is_none()) value_error("int4_asym weights need zeros (mins)");
            py::array z = as_array(zeros_in, "zeros");
            need_dtype(z, "float16", "zeros");
            need_shape(z, {N, G}, "zeros");
            need_contig(z, "zeros");
            view.zeros_f16 = static_cast<const uint16_t*>(z.data());
            zeros = z;
        } else if (!zeros_in.is_none()) {
            value_error("int4_sym weights take no zeros");
        }
        view.group = group;
    }
    view.N = N;
    view.K = K;
    codes = c;
}

int64_t Weight::nbytes() const {
    const WeightView& w = view;
    const WEncInfo& e = wenc_info(w.enc);
    int64_t n = w.N * w.K * e.code_bits / 8;
    if (w.enc == WEnc::i8) n += w.N * 4;  // a float32 scale per row
    if (e.group) n += w.N * (w.K / w.group) * 2 * (e.symmetric ? 1 : 2);  // binary16 scales, mins
    return n;
}

namespace {

// Output and optional residual/bias of a [T, N] GEMM.
struct OutArgs {
    py::array y;
    GemmOut g;
};

OutArgs gemm_out(const py::object& out, const py::object& residual, const py::object& bias,
                 int64_t T, int64_t N, const std::vector<py::array>& inputs) {
    OutArgs o;
    o.y = out_array(out, "float32", {T, N});
    for (const py::array& in : inputs) need_disjoint(o.y, in, "out", "the matmul inputs");
    o.g.y = ptr<float>(o.y);
    o.g.ldy = N;
    if (!residual.is_none()) {
        py::array r = as_array(residual, "residual");
        need_dtype(r, "float32", "residual");
        need_shape(r, {T, N}, "residual");
        need_contig(r, "residual");
        if (r.data() != o.y.data()) need_disjoint(o.y, r, "out", "residual (unless it is the same array)");
        o.g.residual = ptr<float>(r);
        o.g.ldr = N;
    }
    if (!bias.is_none()) {
        py::array b = as_array(bias, "bias");
        need_dtype(b, "float32", "bias");
        need_shape(b, {N}, "bias");
        need_contig(b, "bias");
        o.g.bias = ptr<float>(b);
    }
    return o;
}

// ---- bound functions ----------------------------------------------------------------------

py::tuple py_quantize_act(const py::object& x_in, int64_t group) {
    py::array x = as_array(x_in, "x");
    const int64_t ld = f32_rows(x, "x");
    const int64_t T = x.shape(0), K = x.shape(1);
    if (K < 1) value_error("x must have at least one column");
    const int64_t g = act_group(group, K, "group");
    py::array q = new_array("int8", {T, K});
    py::array s = new_array("float32", {T, K / g});
    Result r;
    {
        py::gil_scoped_release nogil;
        r = infer::quant_act({ptr<float>(x), ld}, T, K, g, ptr<int8_t>(q), ptr<float>(s));
    }
    if (r.status != Status::ok) {
        raise_numeric(r, "quantize_act", "x[" + std::to_string(r.row) + ", " + std::to_string(r.col) + "]");
    }
    return py::make_tuple(q, s);
}

const float* norm_weight(const py::object& w_in, int64_t K, py::array& keep) {
    keep = as_array(w_in, "w");
    need_dtype(keep, "float32", "w");
    need_shape(keep, {K}, "w");
    need_contig(keep, "w");
    return ptr<float>(keep);
}

float check_eps(double eps) {
    if (!(eps >= 0.0) || !std::isfinite(eps)) value_error("eps must be finite and >= 0");
    return static_cast<float>(eps);
}

py::array py_rmsnorm(const py::object& x_in, const py::object& w_in, double eps, const py::object& out) {
    py::array x = as_array(x_in, "x");
    const int64_t ld = f32_rows(x, "x");
    const int64_t T = x.shape(0), K = x.shape(1);
    if (K < 1) value_error("x must have at least one column");
    py::array w;
    const float* wp = norm_weight(w_in, K, w);
    const float e = check_eps(eps);
    py::array y = out_array(out, "float32", {T, K});
    if (y.data() != x.data() || ld != K) need_disjoint(y, x, "out", "x (unless it is x itself)");
    {
        py::gil_scoped_release nogil;
        infer::rmsnorm({ptr<float>(x), ld}, wp, T, K, e, ptr<float>(y), K);
    }
    return y;
}

py::tuple py_rmsnorm_quant(const py::object& x_in, const py::object& w_in, double eps, int64_t group) {
    py::array x = as_array(x_in, "x");
    const int64_t ld = f32_rows(x, "x");
    const int64_t T = x.shape(0), K = x.shape(1);
    if (K < 1) value_error("x must have at least one column");
    py::array w;
    const float* wp = norm_weight(w_in, K, w);
    const float e = check_eps(eps);
    const int64_t g = act_group(group, K, "group");
    py::array q = new_array("int8", {T, K});
    py::array s = new_array("float32", {T, K / g});
    Result r;
    {
        py::gil_scoped_release nogil;
        r = infer::rmsnorm_quant({ptr<float>(x), ld}, wp, T, K, e, g, ptr<int8_t>(q), ptr<float>(s));
    }
    if (r.status != Status::ok) {
        raise_numeric(r, "rmsnorm_quant", "row " + std::to_string(r.row) + ", element " + std::to_string(r.col));
    }
    return py::make_tuple(q, s);
}

struct GateUp {
    py::array g, u;
    int64_t ldg, ldu, T, F;
};

GateUp gate_up(const py::object& gate, const py::object& up) {
    GateUp a;
    a.g = as_array(gate, "gate");
    a.u = as_array(up, "up");
    a.ldg = f32_rows(a.g, "gate");
    a.ldu = f32_rows(a.u, "up");
    a.T = a.g.shape(0);
    a.F = a.g.shape(1);
    need_shape(a.u, {a.T, a.F}, "up");
    if (a.F < 1) value_error("gate must have at least one column");
    return a;
}

py::array py_swiglu(const py::object& gate, const py::object& up, const py::object& out) {
    GateUp a = gate_up(gate, up);
    py::array y = out_array(out, "float32", {a.T, a.F});
    if (!(y.data() == a.g.data() && a.ldg == a.F)) need_disjoint(y, a.g, "out", "gate (unless it is gate itself)");
    if (!(y.data() == a.u.data() && a.ldu == a.F)) need_disjoint(y, a.u, "out", "up (unless it is up itself)");
    {
        py::gil_scoped_release nogil;
        infer::swiglu({ptr<float>(a.g), a.ldg}, {ptr<float>(a.u), a.ldu}, a.T, a.F, ptr<float>(y), a.F);
    }
    return y;
}

py::array py_gated_act(const py::object& gate, const py::object& up, const std::string& act) {
    GatedAct a_kind;
    if (act == "gelu") {
        a_kind = GatedAct::gelu;
    } else if (act == "gelu_tanh") {
        a_kind = GatedAct::gelu_tanh;
    } else if (act == "relu") {
        a_kind = GatedAct::relu;
    } else {
        value_error("act must be gelu, gelu_tanh or relu (SiLU is swiglu), got '" + act + "'");
    }
    GateUp a = gate_up(gate, up);
    py::array y = new_array("float32", {a.T, a.F});
    {
        py::gil_scoped_release nogil;
        infer::gated_act({ptr<float>(a.g), a.ldg}, {ptr<float>(a.u), a.ldu}, a.T, a.F, a_kind, ptr<float>(y), a.F);
    }
    return y;
}

py::tuple py_swiglu_quant(const py::object& gate, const py::object& up, int64_t group) {
    GateUp a = gate_up(gate, up);
    const int64_t g = act_group(group, a.F, "group");
    py::array q = new_array("int8", {a.T, a.F});
    py::array s = new_array("float32", {a.T, a.F / g});
    Result r;
    {
        py::gil_scoped_release nogil;
        r = infer::swiglu_quant({ptr<float>(a.g), a.ldg}, {ptr<float>(a.u), a.ldu}, a.T, a.F, g,
                                ptr<int8_t>(q), ptr<float>(s));
    }
    if (r.status != Status::ok) {
        raise_numeric(r, "swiglu_quant", "row " + std::to_string(r.row) + ", element " + std::to_string(r.col));
    }
    return py::make_tuple(q, s);
}

// inv_freq as float32 [half]: given, or theta ** (-2j / D) rounded once to float32.
std::vector<float> inv_freq_of(const py::object& inv_freq, double theta, int64_t D) {
    const int64_t half = D / 2;
    std::vector<float> f(static_cast<size_t>(half));
    if (!inv_freq.is_none()) {
        py::array a = as_array(inv_freq, "inv_freq");
        need_dtype(a, "float32", "inv_freq");
        need_shape(a, {half}, "inv_freq");
        need_contig(a, "inv_freq");
        std::copy(ptr<float>(a), ptr<float>(a) + half, f.begin());
        return f;
    }
    if (!(theta > 0.0) || !std::isfinite(theta)) value_error("theta must be finite and > 0");
    for (int64_t j = 0; j < half; ++j) {  // float32(theta ** (-2j / D)), evaluated in double
        f[static_cast<size_t>(j)] = static_cast<float>(std::pow(theta, -static_cast<double>(2 * j) / static_cast<double>(D)));
    }
    return f;
}

std::vector<int64_t> positions_of(const py::object& pos_in, int64_t T) {
    py::array p = as_array(pos_in, "positions");
    if (p.dtype().kind() != 'i' && p.dtype().kind() != 'u') type_error("positions must be an integer array, got " + str(p.dtype()));
    need_shape(p, {T}, "positions");
    auto c = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(p);
    if (!c) throw py::error_already_set();
    std::vector<int64_t> v(c.data(), c.data() + T);
    for (int64_t x : v) {
        if (x < 0) value_error("positions must be >= 0");
    }
    return v;
}

void py_rope(const py::object& x_in, const py::object& pos_in, double theta, const py::object& inv_freq,
          const py::object& cos_in, const py::object& sin_in) {
    py::array x = as_array(x_in, "x");
    const int64_t ts = f32_thd(x, "x");
    need_writeable(x, "x");
    const int64_t T = x.shape(0), H = x.shape(1), D = x.shape(2);
    if (D % 2 != 0 || D < 2) value_error("head_dim must be even, got " + std::to_string(D));
    const int64_t half = D / 2;
    const std::vector<int64_t> pos = positions_of(pos_in, T);
    std::vector<float> cs(static_cast<size_t>(T * half)), sn(static_cast<size_t>(T * half));
    if (!cos_in.is_none() || !sin_in.is_none()) {
        if (cos_in.is_none() || sin_in.is_none()) value_error("give both cos and sin, or neither");
        if (!inv_freq.is_none()) value_error("give either cos/sin tables or inv_freq, not both");
        py::array c = as_array(cos_in, "cos"), s = as_array(sin_in, "sin");
        need_dtype(c, "float32", "cos");
        need_dtype(s, "float32", "sin");
        need_ndim(c, 2, "cos");
        const int64_t P = c.shape(0);
        need_shape(c, {P, half}, "cos");
        need_shape(s, {P, half}, "sin");
        need_contig(c, "cos");
        need_contig(s, "sin");
        for (int64_t t = 0; t < T; ++t) {
            if (pos[static_cast<size_t>(t)] >= P) value_error("position " + std::to_string(pos[static_cast<size_t>(t)]) + " is beyond the cos/sin table (" + std::to_string(P) + " rows)");
            std::copy(ptr<float>(c) + pos[static_cast<size_t>(t)] * half, ptr<float>(c) + (pos[static_cast<size_t>(t)] + 1) * half, cs.begin() + t * half);
            std::copy(ptr<float>(s) + pos[static_cast<size_t>(t)] * half, ptr<float>(s) + (pos[static_cast<size_t>(t)] + 1) * half, sn.begin() + t * half);
        }
    } else {
        const std::vector<float> f = inv_freq_of(inv_freq, theta, D);
        infer::rope_table(pos.data(), T, f.data(), half, cs.data(), sn.data());
    }
    py::gil_scoped_release nogil;
    infer::rope(ptr<float>(x), T, ts, H, D, D, cs.data(), sn.data());
}

py::tuple py_rope_table(const py::object& pos_in, int64_t head_dim, double theta, const py::object& inv_freq) {
    if (head_dim < 2 || head_dim % 2 != 0) value_error("head_dim must be even and >= 2");
    py::array p = as_array(pos_in, "positions");
    need_ndim(p, 1, "positions");
    const int64_t n = p.shape(0), half = head_dim / 2;
    const std::vector<int64_t> pos = positions_of(pos_in, n);
    const std::vector<float> f = inv_freq_of(inv_freq, theta, head_dim);
    py::array c = new_array("float32", {n, half}), s = new_array("float32", {n, half});
    infer::rope_table(pos.data(), n, f.data(), half, ptr<float>(c), ptr<float>(s));
    return py::make_tuple(c, s);
}

// ---- matmuls ----------------------------------------------------------------------------

py::array py_linear_q8(const py::object& xq_in, const py::object& xs_in, int64_t group, const Weight& w,
                    const py::object& residual, const py::object& out, const py::object& bias) {
    py::array xq = as_array(xq_in, "xq"), xs = as_array(xs_in, "xs");
    need_dtype(xq, "int8", "xq");
    need_ndim(xq, 2, "xq");
    need_contig(xq, "xq");
    const int64_t T = xq.shape(0), K = xq.shape(1);
    if (K != w.view.K) value_error("xq has " + std::to_string(K) + " columns but the weight has K = " + std::to_string(w.view.K));
    if (w.view.enc == WEnc::f32 || w.view.enc == WEnc::f16 || w.view.enc == WEnc::bf16) {
        value_error(std::string("matmul_q8 needs integer weights, got ") + encoding_name(w.view.enc) + " (use matmul_f32)");
    }
    if (std::memchr(xq.data(), 0x80, static_cast<size_t>(T * K)) != nullptr) {  // int8 -128
        value_error("xq contains -128: activations must be in [-127, 127] (as quantize_act makes them)");
    }
    const int64_t g = act_group(group, K, "act_group");
    if (w.view.enc != WEnc::i8) {
        const int64_t lo = g < w.view.group ? g : w.view.group, hi = g < w.view.group ? w.view.group : g;
        if (hi % lo != 0) {
            value_error("act_group " + std::to_string(g) + " and weight group " + std::to_string(w.view.group) +
                        " must divide one another");
        }
    }
    need_dtype(xs, "float32", "xs");
    need_shape(xs, {T, K / g}, "xs");
    need_contig(xs, "xs");
    OutArgs o = gemm_out(out, residual, bias, T, w.view.N, {xq, xs});
    ActQ8 x;
    x.T = T;
    x.K = K;
    x.group = g;
    x.q = ptr<int8_t>(xq);
    x.s = ptr<float>(xs);
    {
        py::gil_scoped_release nogil;
        infer::matmul_q8(w.view, x, o.g);
    }
    return o.y;
}

py::array py_linear_f32(const py::object& x_in, const Weight& w, const py::object& residual,
                     const py::object& out, const py::object& bias) {
    py::array x = as_array(x_in, "x");
    need_dtype(x, "float32", "x");
    need_ndim(x, 2, "x");
    need_contig(x, "x");
    const int64_t T = x.shape(0), K = x.shape(1);
    if (K != w.view.K) value_error("x has " + std::to_string(K) + " columns but the weight has K = " + std::to_string(w.view.K));
    OutArgs o = gemm_out(out, residual, bias, T, w.view.N, {x});
    ActF32 a;
    a.T = T;
    a.K = K;
    a.x = ptr<float>(x);
    {
        py::gil_scoped_release nogil;
        infer::matmul_f32(w.view, a, o.g);
    }
    return o.y;
}

py::array py_lowrank(const py::object& x_in, const Weight& u, const Weight& v, const py::object& residual,
                  const py::object& out, const py::object& bias) {
    py::array x = as_array(x_in, "x");
    need_dtype(x, "float32", "x");
    need_ndim(x, 2, "x");
    need_contig(x, "x");
    const int64_t T = x.shape(0), K = x.shape(1);
    if (K != v.view.K) value_error("x has " + std::to_string(K) + " columns but V has K = " + std::to_string(v.view.K));
    if (u.view.K != v.view.N) {
        value_error("U [" + std::to_string(u.view.N) + ", " + std::to_string(u.view.K) + "] does not chain with V [" +
                    std::to_string(v.view.N) + ", " + std::to_string(v.view.K) + "]");
    }
    OutArgs o = gemm_out(out, residual, bias, T, u.view.N, {x});
    ActF32 a;
    a.T = T;
    a.K = K;
    a.x = ptr<float>(x);
    {
        py::gil_scoped_release nogil;
        infer::lowrank(u.view, v.view, a, o.g);
    }
    return o.y;
}

// ---- KV cache + attention -------------------------------------------------------------------

}  // namespace

KvHandle kv_cache_from(const py::object& kc, const py::object& ks, const py::object& vc, const py::object& vs,
                       const py::object& table_in, int64_t needed_positions, const py::object& vh,
                       const py::object& vm, bool rotate) {
    KvHandle a = kv_arrays_from(kc, ks, vc, vs, vh, vm, rotate);
    a.keep.push_back(bind_block_table(a.kv, table_in, needed_positions));
    return a;
}

KvHandle kv_arrays_from(const py::object& kc, const py::object& ks, const py::object& vc, const py::object& vs,
                        const py::object& vh, const py::object& vm, bool rotate) {
    KvHandle a;
    KvCache& kv = a.kv;
    kv.rotate = rotate;
    py::array k = as_array(kc, "k_cache"), v = as_array(vc, "v_cache");
    need_ndim(k, 4, "k_cache");
    need_contig(k, "k_cache");
    need_contig(v, "v_cache");
    need_writeable(k, "k_cache");
    need_writeable(v, "v_cache");
    kv.n_blocks = k.shape(0);
    kv.block_size = k.shape(1);
    kv.n_kv_heads = k.shape(2);
    kv.head_dim = k.shape(3);
    const int64_t NB = kv.n_blocks, BS = kv.block_size, H = kv.n_kv_heads, D = kv.head_dim;
    if (NB < 1 || BS < 1 || H < 1 || D < 1) value_error("k_cache must not be empty, got shape " + shape_of(k));
    a.keep = {k, v};
    if (is(k, "float32")) {
        kv.quantized = false;
        if (!ks.is_none() || !vs.is_none()) value_error("a float32 KV cache takes no k_scale / v_scale");
        if (rotate) value_error("rotate goes with a quantized KV cache");
        need_dtype(v, "float32", "v_cache");
        need_shape(v, {NB, BS, H, D}, "v_cache");
        if (overlap(k, v)) value_error("k_cache and v_cache must not overlap");
        kv.kf = ptr<float>(k);
        kv.vf = ptr<float>(v);
    } else {
        need_dtype(k, "int8", "k_cache");
        need_dtype(v, "uint8", "v_cache");
        need_shape(v, {NB, BS, H, D / 2}, "v_cache");
        if (ks.is_none() || vs.is_none()) value_error("a quantized KV cache needs k_scale and v_scale");
        py::array ksa = as_array(ks, "k_scale"), vsa = as_array(vs, "v_scale");
        need_ndim(vsa, 4, "v_scale");
        const int64_t G = vsa.shape(3);
        if (G < 1 || D % G != 0 || (D / G) % 8 != 0 || D / G > 1024) {
            value_error("the V group (head_dim " + std::to_string(D) + " / " + std::to_string(G) +
                        " v_scale groups) must be a multiple of 8, at most 1024");
        }
        kv.v_group = D / G;
        // float16 K scales: the int6-V layout ("int8", uint8 v_scale) or the int5 one ("int8-v5")
        const bool k16 = is(ksa, "float16");
        kv.v6 = k16 && is(vsa, "uint8");
        kv.v5 = k16 && !kv.v6;
        if (!k16) need_dtype(ksa, "float32", "k_scale");
        need_shape(ksa, {NB, BS, H}, "k_scale");
        if (kv.v6) {
            if (vh.is_none() || !vm.is_none()) value_error("the int6 V layout (uint8 v_scale) needs v_high and no v_mins");
            py::array vha = as_array(vh, "v_high");
            need_dtype(vha, "uint8", "v_high");
            need_shape(vha, {NB, BS, H, D / 4}, "v_high");
            need_contig(vha, "v_high");
            need_writeable(vha, "v_high");
            for (const py::array& o : {k, v, ksa, vsa}) {
                if (overlap(vha, o)) value_error("the KV cache arrays must not overlap");
            }
            kv.v_high = ptr<uint8_t>(vha);
            a.keep.push_back(vha);
        } else if (kv.v5) {
            if (vh.is_none() || vm.is_none()) value_error("a float16 k_scale (int5 V) needs v_high and v_mins");
            if (!is(vsa, "float16")) type_error("the int5 V layout needs a float16 v_scale");
            py::array vha = as_array(vh, "v_high"), vma = as_array(vm, "v_mins");
            need_dtype(vha, "uint8", "v_high");
            need_shape(vha, {NB, BS, H, D / 8}, "v_high");
            need_dtype(vma, "float16", "v_mins");
            need_shape(vma, {NB, BS, H, G}, "v_mins");
            for (const py::array& p : {vha, vma}) {
                need_contig(p, "v_high / v_mins");
                need_writeable(p, "v_high / v_mins");
                for (const py::array& o : {k, v, ksa, vsa}) {
                    if (overlap(p, o)) value_error("the KV cache arrays must not overlap");
                }
            }
            if (overlap(vha, vma)) value_error("the KV cache arrays must not overlap");
            kv.v_high = ptr<uint8_t>(vha);
            kv.v_min = ptr<uint16_t>(vma);
            a.keep.push_back(vha);
            a.keep.push_back(vma);
        } else if (!vh.is_none() || !vm.is_none()) {
            value_error("v_high / v_mins go with a float16 k_scale (the int5 V layout)");
        }
        need_contig(ksa, "k_scale");
        need_writeable(ksa, "k_scale");
        if (is(vsa, "float16") || kv.v6) {
            kv.v_scale_f16 = !kv.v6;
        } else if (is(vsa, "float32")) {
            kv.v_scale_f16 = false;
        } else {
            type_error("v_scale must be float16 or float32, got " + str(vsa.dtype()));
        }
        need_shape(vsa, {NB, BS, H, G}, "v_scale");
        need_contig(vsa, "v_scale");
        need_writeable(vsa, "v_scale");
        const py::array parts[4] = {k, v, ksa, vsa};
        for (int i = 0; i < 4; ++i) {
            for (int j = i + 1; j < 4; ++j) {
                if (overlap(parts[i], parts[j])) value_error("k_cache, k_scale, v_cache and v_scale must not overlap");
            }
        }
        kv.k = ptr<int8_t>(k);
        kv.v = ptr<uint8_t>(v);
        if (k16) {
            kv.k_scale16 = ptr<uint16_t>(ksa);
        } else {
            kv.k_scale = ptr<float>(ksa);
        }
        kv.v_scale = const_cast<void*>(vsa.data());
        a.keep.push_back(ksa);
        a.keep.push_back(vsa);
    }
    return a;
}

py::array bind_block_table(KvCache& kv, const py::object& table_in, int64_t needed_positions) {
    py::array t = as_array(table_in, "block_table");
    need_dtype(t, "int32", "block_table");
    need_ndim(t, 1, "block_table");
    need_contig(t, "block_table");
    const int64_t NB = kv.n_blocks, BS = kv.block_size;
    const int64_t used = (needed_positions + BS - 1) / BS;
    if (t.shape(0) < used) {
        value_error("block_table has " + std::to_string(t.shape(0)) + " entries but positions up to " +
                    std::to_string(needed_positions) + " need " + std::to_string(used));
    }
    const int32_t* tp = ptr<int32_t>(t);
    for (int64_t i = 0; i < used; ++i) {
        if (tp[i] < 0 || tp[i] >= NB) {
            value_error("block_table[" + std::to_string(i) + "] = " + std::to_string(tp[i]) + " is not a block of the pool (0.." + std::to_string(NB - 1) + ")");
        }
    }
    kv.table = tp;
    kv.table_len = t.shape(0);
    return t;
}

namespace {

// q/k/v of T tokens: [T, H, D] (or [H, D] when `single`).
py::array thd(const py::object& o, const char* name, bool single) {
    py::array a = as_array(o, name);
    if (single && a.ndim() == 2) {
        need_dtype(a, "float32", name);
        py::array r = a[py::make_tuple(py::none(), py::ellipsis())];
        return r;
    }
    return a;
}

// Keyword options of the attention entry points (defaults: the plain Llama attention).
struct AttnOpts {
    bool rotate = false;   // the cache holds Hadamard-rotated K/V (layout "int8")
    int64_t window = 0;    // sliding window, 0: none
    double softcap = 0.0;  // score soft-capping, 0: none
};

py::array py_attention(const py::object& q_in, const py::object& k_in, const py::object& v_in, const py::object& kc,
                    const py::object& ks, const py::object& vc, const py::object& vs, const py::object& table,
                    int64_t start, const py::object& scale_in, const py::object& out_in, bool decode, bool write_only,
                    const py::object& vh, const py::object& vm, const AttnOpts& opts = AttnOpts{}) {
    const char* op = write_only ? "kv_write" : decode ? "attention_decode" : "attention_prefill";
    if (start < 0) value_error("position must be >= 0");
    py::array k = thd(k_in, "k", decode), v = thd(v_in, "v", decode);
    const int64_t kts = f32_thd(k, "k"), vts = f32_thd(v, "v");
    const int64_t T = k.shape(0);
    if (T < 1) value_error("k must hold at least one token");
    if (decode && T != 1) value_error("attention_decode takes one token; use attention_prefill");
    KvHandle c = kv_cache_from(kc, ks, vc, vs, table, start + T, vh, vm, opts.rotate);
    const KvCache& kv = c.kv;
    const int64_t Hkv = kv.n_kv_heads, D = kv.head_dim;
    need_shape(k, {T, Hkv, D}, "k");
    need_shape(v, {T, Hkv, D}, "v");
    for (const py::array& part : c.keep) {
        need_disjoint(part, k, "the KV cache", "k");
        need_disjoint(part, v, "the KV cache", "v");
    }
    AttnArgs a;
    a.k = ptr<float>(k);
    a.kts = kts;
    a.v = ptr<float>(v);
    a.vts = vts;
    a.T = T;
    a.start = start;
    if (write_only) {
        Result r;
        {
            py::gil_scoped_release nogil;
            r = infer::kv_append(kv, a);
        }
        if (r.status != Status::ok) raise_numeric(r, op, kv_where(r, Hkv));
        return py::array();
    }
    py::array q = thd(q_in, "q", decode);
    const int64_t qts = f32_thd(q, "q");
    const int64_t Hq = q.shape(1);
    need_shape(q, {T, Hq, D}, "q");
    if (Hq < 1 || Hq % Hkv != 0) value_error("n_heads (" + std::to_string(Hq) + ") must be a multiple of n_kv_heads (" + std::to_string(Hkv) + ")");
    double scale = 1.0 / std::sqrt(static_cast<double>(D));
    if (!scale_in.is_none()) scale = scale_in.cast<double>();
    if (!std::isfinite(scale)) value_error("scale must be finite");
    py::array out = out_array(out_in, "float32", decode ? Shape{Hq, D} : Shape{T, Hq, D});
    for (const py::array& part : c.keep) need_disjoint(out, part, "out", "the KV cache");
    need_disjoint(out, q, "out", "q");
    need_disjoint(out, k, "out", "k");
    need_disjoint(out, v, "out", "v");
    a.q = ptr<float>(q);
    a.qts = qts;
    a.n_heads = Hq;
    a.scale = static_cast<float>(scale);
    a.out = ptr<float>(out);
    if (opts.window < 0) value_error("window must be >= 0 (0: none)");
    if (!(opts.softcap >= 0.0) || !std::isfinite(opts.softcap)) value_error("softcap must be finite and >= 0 (0: none)");
    a.window = opts.window;
    a.softcap = static_cast<float>(opts.softcap);
    Result r;
    {
        py::gil_scoped_release nogil;
        r = infer::attention(kv, a);
    }
    if (r.status != Status::ok) raise_numeric(r, op, kv_where(r, Hkv));
    return out;
}

py::tuple py_kv_read(const py::object& kc, const py::object& ks, const py::object& vc, const py::object& vs,
                  const py::object& table, int64_t length, const py::object& vh, const py::object& vm,
                  bool rotate) {
    if (length < 0) value_error("length must be >= 0");
    KvHandle c = kv_cache_from(kc, ks, vc, vs, table, length, vh, vm, rotate);
    const int64_t H = c.kv.n_kv_heads, D = c.kv.head_dim;
    py::array k = new_array("float32", {length, H, D}), v = new_array("float32", {length, H, D});
    {
        py::gil_scoped_release nogil;
        infer::kv_read(c.kv, length, ptr<float>(k), ptr<float>(v));
    }
    return py::make_tuple(k, v);
}

}  // namespace

void bind_infer(py::module_& m) {
    numeric_error();
    m.attr("NumericError") = numeric_error();

    m.def("set_threads", [](int n, const py::object& spin_us) {
        if (n < 1 || n > 256) value_error("threads must be in [1, 256], got " + std::to_string(n));
        int64_t us = -1;
        if (!spin_us.is_none()) {
            us = spin_us.cast<int64_t>();
            if (us < 0) value_error("spin_us must be >= 0");
        }
        py::gil_scoped_release nogil;
        if (us >= 0) ThreadPool::instance().set_spin_us(us);
        ThreadPool::instance().set_threads(n);
    }, py::arg("n"), py::arg("spin_us") = py::none(),
          "Size of the persistent pool used by the inference kernels (caller included).");
    m.def("get_threads", []() { return ThreadPool::instance().threads(); });
    m.def("_read_probe", [](const py::object& a_in) {
        py::array a = as_array(a_in, "a");
        need_contig(a, "a");
        const auto* p = static_cast<const uint8_t*>(a.data());
        const int64_t n = a.nbytes();
        py::gil_scoped_release nogil;
        return infer::read_probe(p, n);
    }, py::arg("a"), "Read every byte of a (memory-bandwidth probe for bench/kernels.py).");

    m.def("argmax_rows", [](const py::object& x_in) {
        py::array x = as_array(x_in, "x");
        need_dtype(x, "float32", "x");
        need_ndim(x, 2, "x");
        need_contig(x, "x");
        const int64_t T = x.shape(0), n = x.shape(1);
        if (n < 1) value_error("x must have at least one column");
        py::array_t<int64_t> picks(T);
        int64_t* p = picks.mutable_data();
        const float* xp = static_cast<const float*>(x.data());
        {
            py::gil_scoped_release nogil;
            infer::argmax_rows(xp, T, n, p);
        }
        return picks;
    }, py::arg("x"), "Each row's argmax as numpy's (the first maximum, or the first NaN): Stack.run's picks.");
    m.def("quantize_act", &py_quantize_act, py::arg("x"), py::arg("group") = 0);
    m.def("rmsnorm", &py_rmsnorm, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("out") = py::none());
    m.def("rmsnorm_quant", &py_rmsnorm_quant, py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("group") = 0);
    m.def("swiglu", &py_swiglu, py::arg("gate"), py::arg("up"), py::arg("out") = py::none());
    m.def("swiglu_quant", &py_swiglu_quant, py::arg("gate"), py::arg("up"), py::arg("group") = 0);
    m.def("gated_act", &py_gated_act, py::arg("gate"), py::arg("up"), py::arg("act"),
          "act(gate) * up for act in gelu, gelu_tanh, relu (the numpy reference's numerics).");
    m.def("rope", &py_rope, py::arg("x"), py::arg("positions"), py::kw_only(), py::arg("theta") = 10000.0,
          py::arg("inv_freq") = py::none(), py::arg("cos") = py::none(), py::arg("sin") = py::none());
    m.def("rope_table", &py_rope_table, py::arg("positions"), py::arg("head_dim"), py::kw_only(),
          py::arg("theta") = 10000.0, py::arg("inv_freq") = py::none());

    py::class_<Weight>(m, "Weight", "A validated weight matrix [N, K] bound once (no copy).")
        .def(py::init<const py::object&, const py::object&, const py::object&, const py::object&, int64_t>(),
             py::arg("codes"), py::arg("scales") = py::none(), py::arg("zeros") = py::none(),
             py::arg("encoding") = "f32", py::arg("group") = 0)
        .def_property_readonly("shape", [](const Weight& w) { return py::make_tuple(w.view.N, w.view.K); })
        .def_property_readonly("encoding", [](const Weight& w) { return std::string(encoding_name(w.view.enc)); })
        .def_property_readonly("group", [](const Weight& w) { return w.view.group; })
        .def_property_readonly("nbytes", &Weight::nbytes)
        .def("q8_prep_bytes", [](const Weight& w, int64_t act_group) { return active().q8_prep_bytes(w.view, act_group); },
             py::arg("act_group"), "Bytes per token the active kernels lay an int8 input out in (0: none).")
        .def("__repr__", [](const Weight& w) {
            return "Weight(" + std::string(encoding_name(w.view.enc)) + ", shape=(" + std::to_string(w.view.N) + ", " +
                   std::to_string(w.view.K) + "), group=" + std::to_string(w.view.group) + ")";
        });

    m.def("linear_q8", &py_linear_q8, py::arg("xq"), py::arg("xs"), py::arg("act_group"), py::arg("w"),
          py::arg("residual") = py::none(), py::arg("out") = py::none(), py::kw_only(), py::arg("bias") = py::none());
    m.def("linear_f32", &py_linear_f32, py::arg("x"), py::arg("w"), py::arg("residual") = py::none(),
          py::arg("out") = py::none(), py::kw_only(), py::arg("bias") = py::none());
    m.def("matmul_q8",
          [](const py::object& xq, const py::object& xs, int64_t group, const py::object& codes, const py::object& scales,
             const py::object& zeros, const py::object& enc, int64_t w_group, const py::object& residual,
             const py::object& out, const py::object& bias) {
              const Weight w(codes, scales, zeros, enc, w_group);
              return py_linear_q8(xq, xs, group, w, residual, out, bias);
          },
          py::arg("xq"), py::arg("xs"), py::arg("act_group"), py::arg("w_codes"), py::arg("w_scales"),
          py::arg("w_zeros"), py::arg("weight_encoding"), py::arg("w_group"), py::arg("residual") = py::none(),
          py::arg("out") = py::none(), py::kw_only(), py::arg("bias") = py::none());
    m.def("matmul_f32",
          [](const py::object& x, const py::object& codes, const py::object& scales, const py::object& zeros,
             const py::object& enc, int64_t w_group, const py::object& residual, const py::object& out,
             const py::object& bias) {
              const Weight w(codes, scales, zeros, enc, w_group);
              return py_linear_f32(x, w, residual, out, bias);
          },
          py::arg("x"), py::arg("w_codes"), py::arg("w_scales") = py::none(), py::arg("w_zeros") = py::none(),
          py::arg("weight_encoding") = "f32", py::arg("w_group") = 0, py::arg("residual") = py::none(),
          py::arg("out") = py::none(), py::kw_only(), py::arg("bias") = py::none());
    m.def("lowrank", &py_lowrank, py::arg("x"), py::arg("u"), py::arg("v"), py::arg("residual") = py::none(),
          py::arg("out") = py::none(), py::kw_only(), py::arg("bias") = py::none());

    m.def("kv_write",
          [](const py::object& k, const py::object& v, const py::object& kc, const py::object& ks, const py::object& vc,
             const py::object& vs, const py::object& table, int64_t start, const py::object& vh, const py::object& vm,
             bool rotate) {
              py_attention(py::none(), k, v, kc, ks, vc, vs, table, start, py::none(), py::none(), false, true, vh, vm,
                           AttnOpts{rotate, 0, 0.0});
          },
          py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("k_scale"), py::arg("v_cache"),
          py::arg("v_scale"), py::arg("block_table"), py::arg("start_pos"), py::kw_only(),
          py::arg("v_high") = py::none(), py::arg("v_mins") = py::none(), py::arg("rotate") = false);
    m.def("attention_decode",
          [](const py::object& q, const py::object& k, const py::object& v, const py::object& kc, const py::object& ks,
             const py::object& vc, const py::object& vs, const py::object& table, int64_t pos, const py::object& scale,
             const py::object& out, const py::object& vh, const py::object& vm, bool rotate, int64_t window,
             double softcap) {
              return py_attention(q, k, v, kc, ks, vc, vs, table, pos, scale, out, true, false, vh, vm,
                                  AttnOpts{rotate, window, softcap});
          },
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("k_scale"), py::arg("v_cache"),
          py::arg("v_scale"), py::arg("block_table"), py::arg("pos"), py::kw_only(), py::arg("scale") = py::none(),
          py::arg("out") = py::none(), py::arg("v_high") = py::none(), py::arg("v_mins") = py::none(),
          py::arg("rotate") = false, py::arg("window") = 0, py::arg("softcap") = 0.0);
    m.def("attention_prefill",
          [](const py::object& q, const py::object& k, const py::object& v, const py::object& kc, const py::object& ks,
             const py::object& vc, const py::object& vs, const py::object& table, int64_t start, const py::object& scale,
             const py::object& out, const py::object& vh, const py::object& vm, bool rotate, int64_t window,
             double softcap) {
              return py_attention(q, k, v, kc, ks, vc, vs, table, start, scale, out, false, false, vh, vm,
                                  AttnOpts{rotate, window, softcap});
          },
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("k_scale"), py::arg("v_cache"),
          py::arg("v_scale"), py::arg("block_table"), py::arg("start_pos"), py::kw_only(), py::arg("scale") = py::none(),
          py::arg("out") = py::none(), py::arg("v_high") = py::none(), py::arg("v_mins") = py::none(),
          py::arg("rotate") = false, py::arg("window") = 0, py::arg("softcap") = 0.0);
    m.def("kv_read", &py_kv_read, py::arg("k_cache"), py::arg("k_scale"), py::arg("v_cache"), py::arg("v_scale"),
          py::arg("block_table"), py::arg("length"), py::kw_only(), py::arg("v_high") = py::none(),
          py::arg("v_mins") = py::none(), py::arg("rotate") = false);

    bind_layer(m);
}

}  // namespace infer
}  // namespace edgepack
