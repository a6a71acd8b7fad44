// Whole decoder layer in one native call: decoder_layer(lw, x, ctx) -> (x_out | None,
// reason | None), the contract of edgepack.runtime_shim.kernels (Kernels.decoder_layer),
// reproducing its composite layer op for op:
//
//   attention: RMSNorm (fused with activation quantization when q/k/v share an activation
//   group) -> q/k/v projections (+bias) -> RoPE (cos/sin rows per token) -> KV write
//   (quantize on write) + causal attention -> quantize -> o projection + residual;
//   FFN: RMSNorm (+quantize when gate/up share a group) -> gate, up -> SwiGLU (fused with
//   the quantization for down) -> down + residual.
//
// Int8-activation path (ctx.act_int8): a quantization that meets NaN/Inf or yields a scale
// above 65504, or non-finite K/V, return (None, reason), so the runtime recomputes the
// layer with float activations; a non-finite output returns (x_out, reason).  The reasons
// are the Fallback enum's strings (fallback.h).  On the float path non-finite K/V raise
// edgepack.runtime_shim.NumericError carrying the kernel's Status code.  Python attributes are read once per
// call (a few microseconds), then the whole layer runs without the GIL on the pool, which
// keeps spinning between the ~12 ops instead of sleeping.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "../fp16.h"
#include "bind_infer.h"
#include "fallback.h"
#include "layer_arena.h"
#include "ops.h"

namespace py = pybind11;

namespace edgepack {
namespace infer {
namespace {

constexpr float kActScaleMax = 65504.0f;  // runtime_shim.kernels.ACT_SCALE_MAX

struct Lin {
    const WeightView* w = nullptr;  // dense weight
    const WeightView* u = nullptr;  // low rank: y = U (V x)
    const WeightView* v = nullptr;
    const float* bias = nullptr;
    int64_t act_group = 0;
    bool quantized = false;
    int64_t N = 0, K = 0;
    // LoRA adapter (runtime_shim.adapters.LoraPair): y += s * (x A^T) B^T, with A [rank, K]
    // as stored (int8 per row, f16 or f32), B^T [rank, N] and s the session's scale times
    // the target's.  rank == 0: no adapter.
    WeightView lora_a;
    LoraUp lora_b;
    float lora_scale = 1.0f;
    int64_t rank = 0;
};

// An activation as passed between ops: float rows, or int8 codes with group scales.
struct Act {
    const float* x = nullptr;
    const int8_t* q = nullptr;
    const float* s = nullptr;
    int64_t group = 0;
};

// The call-wide arguments (parse_call): the same for every layer of one forward.
struct CallArgs {
    int64_t T = 0, hidden = 0, nh = 0, nkv = 0, hd = 0, start = 0;
    float eps = 0.0f;
    int act_kind = 0;         // 0: SiLU (SwiGLU), else a GatedAct
    double attn_scale = 0.0;  // 0: 1/sqrt(hd)
    float softcap = 0.0f;
    const float* cos = nullptr;
    const float* sin = nullptr;
    bool act = false;
    const float* x = nullptr;
};

// One layer's arguments: the call's, and the layer's own (parse_weights, parse_kv).
struct LayerArgs : CallArgs {
    Lin q, k, v, o, gate, up, down;
    const float* attn_norm = nullptr;
    const float* ffn_norm = nullptr;
    const float* q_norm = nullptr;  // [hd] per-head RMSNorm of q and k before RoPE (qwen3)
    const float* k_norm = nullptr;
    const float* attn_post_norm = nullptr;  // [hidden] norms of the attention / FFN outputs
    const float* ffn_post_norm = nullptr;   // before their residual add (gemma2)
    int64_t window = 0;
    int64_t qkv_group = 0, gate_up_group = 0;  // 0: quantize per weight
    int64_t ffn = 0;
    KvCache kv;
    float* out = nullptr;
};

// A layer call's buffers: each slot at its offset in the planned arena (ctx.arena), or,
// without one, in its own grow-only per-thread region (nothing shared, as with reuse off).
// A slot is taken at most once per call, and never beyond the bytes its plan gives it.
struct Arena {
    const ArenaPlan* plan = nullptr;
    uint8_t* base = nullptr;
    uint64_t taken = 0;
    template <class T>
    T* get(int slot, int64_t n) {
        const int64_t bytes = (n * static_cast<int64_t>(sizeof(T)) + kArenaAlign - 1) & ~(kArenaAlign - 1);
        if (taken & (uint64_t{1} << slot)) throw std::logic_error("decoder_layer: arena slot " + slot_name(slot) + " taken twice");
        taken |= uint64_t{1} << slot;
        if (plan == nullptr) {
            thread_local std::vector<uint8_t> own[kSlots];
            if (own[slot].size() < static_cast<size_t>(bytes)) own[slot].resize(static_cast<size_t>(bytes));
            return reinterpret_cast<T*>(own[slot].data());
        }
        if (bytes > plan->size[slot]) {
            throw std::length_error("decoder_layer: the memory plan gives " + slot_name(slot) + " " +
                                    std::to_string(plan->size[slot]) + " bytes, the layer needs " + std::to_string(bytes));
        }
        return reinterpret_cast<T*>(base + plan->offset[slot]);
    }

    // n T at `slot` when the plan gives it that many bytes, else nullptr (no plan, or one
    // made for kernels with a smaller layout: set_isa after open): the op's own scratch serves.
    template <class T>
    T* planned(int slot, int64_t n) {
        const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
        if (plan == nullptr || n <= 0 || plan->size[slot] < bytes) return nullptr;
        return get<T>(slot, n);
    }
};

bool overflowed(const Result& r, const float* s, int64_t n) {
    if (r.status != Status::ok) return true;
    for (int64_t i = 0; i < n; ++i) {
        if (s[i] > kActScaleMax) return true;
    }
    return false;
}

// Layer-call state: the arena, and activations quantized once per group per input.
struct Runner {
    const LayerArgs& a;
    Arena& ar;

    struct Cached {
        const float* src;
        Act act;
    };
    std::vector<Cached> cache;

    // The linear apply() is running (its slots hold its dequantized and adapter inputs).
    int cur = 0;
    int lin_index(const Lin& l) const {
        const Lin* all[kLinears] = {&a.q, &a.k, &a.v, &a.o, &a.gate, &a.up, &a.down};
        for (int i = 0; i < kLinears; ++i) {
            if (all[i] == &l) return i;
        }
        throw std::logic_error("decoder_layer: a linear outside the layer");
    }

    // Codes at `slot`; an adapter input dequantized from codes once at that address is stale
    // (a planned slot reuses the bytes of buffers no longer live).
    int8_t* codes(int slot, int64_t n) {
        int8_t* q = ar.get<int8_t>(slot, n);
        const auto at_q = [q](const std::pair<const int8_t*, const float*>& e) { return e.first == q; };
        lora_inputs.erase(std::remove_if(lora_inputs.begin(), lora_inputs.end(), at_q), lora_inputs.end());
        return q;
    }

    // The input a weight takes: x itself, or x quantized with the weight's group (once).
    bool input_for(const Lin& l, const float* x, int64_t K, Act* out) {
        if (!(a.act && l.quantized)) {
            *out = Act{x, nullptr, nullptr, 0};
            return true;
        }
        for (const Cached& c : cache) {
            if (c.src == x && c.act.group == l.act_group) {
                *out = c.act;
                return true;
            }
        }
        const int64_t g = l.act_group;
        const int li = lin_index(l);
        int8_t* q = codes(slot_of(li, LinSlot::in_q8), a.T * K);
        float* s = ar.get<float>(slot_of(li, LinSlot::in_s), a.T * (K / g));
        const Result r = quant_act({x, K}, a.T, K, g, q, s);
        if (overflowed(r, s, a.T * (K / g))) return false;
        *out = Act{nullptr, q, s, g};
        cache.push_back({x, *out});
        return true;
    }

    const float* as_float(const Act& in, int64_t K) {
        if (in.x != nullptr) return in.x;
        float* x = ar.get<float>(slot_of(cur, LinSlot::in_f), a.T * K);  // QuantizedActivations.dequantize(): q * s
        for (int64_t i = 0; i < a.T * K; ++i) {
            x[i] = static_cast<float>(in.q[i]) * in.s[(i / K) * (K / in.group) + (i % K) / in.group];
        }
        return x;
    }

    void apply(const Lin& l, const Act& in, float* y, const float* residual) {
        cur = lin_index(l);
        GemmOut o;
        o.y = y;
        o.ldy = l.N;
        o.residual = residual;
        o.ldr = l.N;
        o.bias = l.bias;
        if (l.u != nullptr) {
            lowrank(*l.u, *l.v, act_f32(as_float(in, l.K), l.K), o);
        } else if (in.q != nullptr && l.quantized) {
            ActQ8 x = act_q8(in, l.K);
            x.prep = ar.planned<uint8_t>(slot_of(cur, LinSlot::prep), a.T * active().q8_prep_bytes(*l.w, in.group));
            matmul_q8(*l.w, x, o);
        } else {
            matmul_f32(*l.w, act_f32(as_float(in, l.K), l.K), o);
        }
        if (l.rank > 0) add_lora(l, in, y);
    }

    // apply() of n linears reading the same input (q/k/v, gate/up): a small pass's int8
    // products as one pool job (matmul_q8_shared: each output's bits, one barrier);
    // anything else (large passes, float or low-rank weights, adapters) one by one.
    void apply_all(const Lin* const* ls, const Act* ins, float* const* ys, int n) {
        bool one_job = n <= kSharedMaxWeights && ins[0].q != nullptr && matmul_q8_shared_fits(act_q8(ins[0], ls[0]->K));
        for (int i = 0; i < n && one_job; ++i) {
            const Lin& l = *ls[i];
            one_job = l.u == nullptr && l.rank == 0 && l.quantized && ins[i].q != nullptr && ins[i].q == ins[0].q &&
                      ins[i].s == ins[0].s && ins[i].group == ins[0].group && l.K == ls[0]->K;
        }
        if (!one_job) {
            for (int i = 0; i < n; ++i) apply(*ls[i], ins[i], ys[i], nullptr);
            return;
        }
        const WeightView* ws[kSharedMaxWeights];
        GemmOut outs[kSharedMaxWeights];
        for (int i = 0; i < n; ++i) {
            ws[i] = ls[i]->w;
            outs[i].y = ys[i];
            outs[i].ldy = ls[i]->N;
            outs[i].ldr = ls[i]->N;
            outs[i].bias = ls[i]->bias;
        }
        matmul_q8_shared(ws, outs, n, act_q8(ins[0], ls[0]->K));
    }

    ActQ8 act_q8(const Act& in, int64_t K) const {
        ActQ8 x;
        x.T = a.T;
        x.K = K;
        x.group = in.group;
        x.q = in.q;
        x.s = in.s;
        return x;
    }

    ActF32 act_f32(const float* xf, int64_t K) const {
        ActF32 x;
        x.T = a.T;
        x.K = K;
        x.x = xf;
        return x;
    }

    // y[T, N] += s * (x A^T) B^T on the kernels of the active ISA, the factors read in
    // their stored encoding.  An int8 input meets int8 A in the integer kernel; otherwise A
    // reads the input's float values (the int8 path's quantized activations dequantized,
    // as the numpy chain does).
    void add_lora(const Lin& l, const Act& in, float* y) {
        const int64_t r = l.rank;
        float* h = ar.get<float>(slot_of(cur, LinSlot::lora_h), a.T * r);
        GemmOut mid;
        mid.y = h;
        mid.ldy = r;
        if (in.q != nullptr && l.lora_a.enc == WEnc::i8) {
            matmul_q8(l.lora_a, act_q8(in, l.K), mid);
        } else {
            matmul_f32(l.lora_a, act_f32(lora_input(in, l.K), l.K), mid);
        }
        for (int64_t i = 0; i < a.T * r; ++i) h[i] *= l.lora_scale;
        lora_up(l.lora_b, h, a.T, y, l.N);
    }

    // The float values of an adapter's input, dequantized once per quantized input (q, k
    // and v share one) with one scale per group: no division per element.
    std::vector<std::pair<const int8_t*, const float*>> lora_inputs;
    const float* lora_input(const Act& in, int64_t K) {
        if (in.x != nullptr) return in.x;
        for (const auto& e : lora_inputs) {
            if (e.first == in.q) return e.second;
        }
        float* x = ar.get<float>(slot_of(cur, LinSlot::lora_x), a.T * K);
        const int64_t G = K / in.group;
        for (int64_t t = 0; t < a.T; ++t) {
            for (int64_t g = 0; g < G; ++g) {
                const float s = in.s[t * G + g];
                const int8_t* q = in.q + t * K + g * in.group;
                float* xo = x + t * K + g * in.group;
                for (int64_t i = 0; i < in.group; ++i) xo[i] = static_cast<float>(q[i]) * s;
            }
        }
        lora_inputs.emplace_back(in.q, x);
        return x;
    }

    // y = x + l(in), or x + rmsnorm(l(in), post_norm) (sandwich norms), as the composite does.
    void project_add(const Lin& l, const Act& in, const float* x, const float* post_norm, float* y) {
        if (post_norm == nullptr) {
            apply(l, in, y, x);
            return;
        }
        const int64_t n = a.T * l.N;
        float* p = ar.get<float>(slot_of(&l == &a.o ? Slot::attn_post : Slot::ffn_post), n);
        apply(l, in, p, nullptr);
        rmsnorm({p, l.N}, post_norm, a.T, l.N, a.eps, p, l.N);
        for (int64_t i = 0; i < n; ++i) y[i] = x[i] + p[i];
    }

    // Why the layer gave up (Fallback::none: it ran through).  Non-finite K/V on the float
    // path set `kv_error` (the attention Result): the caller raises instead.
    Result kv_error;

    Fallback run() {
        const int64_t T = a.T, H = a.hidden, QD = a.nh * a.hd, KD = a.nkv * a.hd, F = a.ffn;
        // ---- attention
        Act ins[3];
        if (a.act && a.qkv_group > 0) {
            int8_t* q = codes(slot_of(Slot::attn_q8), T * H);
            float* s = ar.get<float>(slot_of(Slot::attn_s), T * (H / a.qkv_group));
            const Result r = rmsnorm_quant({a.x, H}, a.attn_norm, T, H, a.eps, a.qkv_group, q, s);
            if (overflowed(r, s, T * (H / a.qkv_group))) return Fallback::attention_input;
            ins[0] = ins[1] = ins[2] = Act{nullptr, q, s, a.qkv_group};
        } else {
            float* h = ar.get<float>(slot_of(Slot::attn_h), T * H);
            rmsnorm({a.x, H}, a.attn_norm, T, H, a.eps, h, H);
            const Lin* l3[3] = {&a.q, &a.k, &a.v};
            for (int i = 0; i < 3; ++i) {
                if (!input_for(*l3[i], h, H, &ins[i])) return Fallback::attention_input;
            }
        }
        float* qb = ar.get<float>(slot_of(Slot::q_out), T * QD);
        float* kb = ar.get<float>(slot_of(Slot::k_out), T * KD);
        float* vb = ar.get<float>(slot_of(Slot::v_out), T * KD);
        const Lin* qkv[3] = {&a.q, &a.k, &a.v};
        float* const qkv_out[3] = {qb, kb, vb};
        apply_all(qkv, ins, qkv_out, 3);
        if (a.q_norm != nullptr) {  // in place: each row's factor is taken before it is written
            rmsnorm({qb, a.hd}, a.q_norm, T * a.nh, a.hd, a.eps, qb, a.hd);
            rmsnorm({kb, a.hd}, a.k_norm, T * a.nkv, a.hd, a.eps, kb, a.hd);
        }
        rope(qb, T, QD, a.nh, a.hd, a.hd, a.cos, a.sin);
        rope(kb, T, KD, a.nkv, a.hd, a.hd, a.cos, a.sin);
        float* att = ar.get<float>(slot_of(Slot::att), T * QD);
        AttnArgs at;
        at.q = qb;
        at.qts = QD;
        at.k = kb;
        at.kts = KD;
        at.v = vb;
        at.vts = KD;
        at.T = T;
        at.n_heads = a.nh;
        at.start = a.start;
        at.scale = static_cast<float>(a.attn_scale > 0.0 ? a.attn_scale : 1.0 / std::sqrt(static_cast<double>(a.hd)));
        at.out = att;
        at.window = a.window;
        at.softcap = a.softcap;
        if (a.kv.rotate) {  // the rotated copies it makes (none planned: its scratch)
            at.rot_q = ar.planned<float>(slot_of(Slot::q_rot), T * QD);
            at.rot_k = ar.planned<float>(slot_of(Slot::k_rot), T * KD);
            at.rot_v = ar.planned<float>(slot_of(Slot::v_rot), T * KD);
        }
        const Result kv_r = attention(a.kv, at);
        if (kv_r.status != Status::ok) {
            if (!a.act) kv_error = kv_r;
            return Fallback::non_finite_kv;
        }
        Act ao;
        cache.clear();
        if (!input_for(a.o, att, QD, &ao)) return Fallback::attention_output;
        float* x1 = ar.get<float>(slot_of(Slot::x1), T * H);
        project_add(a.o, ao, a.x, a.attn_post_norm, x1);
        // ---- FFN
        cache.clear();
        Act gi[2];
        if (a.act && a.gate_up_group > 0) {
            int8_t* q = codes(slot_of(Slot::ffn_q8), T * H);
            float* s = ar.get<float>(slot_of(Slot::ffn_s), T * (H / a.gate_up_group));
            const Result r = rmsnorm_quant({x1, H}, a.ffn_norm, T, H, a.eps, a.gate_up_group, q, s);
            if (overflowed(r, s, T * (H / a.gate_up_group))) return Fallback::ffn_input;
            gi[0] = gi[1] = Act{nullptr, q, s, a.gate_up_group};
        } else {
            float* h = ar.get<float>(slot_of(Slot::ffn_h), T * H);
            rmsnorm({x1, H}, a.ffn_norm, T, H, a.eps, h, H);
            if (!input_for(a.gate, h, H, &gi[0]) || !input_for(a.up, h, H, &gi[1])) {
                return Fallback::ffn_input;
            }
        }
        float* gb = ar.get<float>(slot_of(Slot::gate_out), T * F);
        float* ub = ar.get<float>(slot_of(Slot::up_out), T * F);
        const Lin* gate_up[2] = {&a.gate, &a.up};
        float* const gate_up_out[2] = {gb, ub};
        apply_all(gate_up, gi, gate_up_out, 2);
        Act di;
        if (a.act_kind != 0) {  // act(gate) * up in float, then quantized like any input
            float* sb = ar.get<float>(slot_of(Slot::act_out), T * F);
            gated_act({gb, F}, {ub, F}, T, F, static_cast<GatedAct>(a.act_kind), sb, F);
            cache.clear();
            if (!input_for(a.down, sb, F, &di)) return Fallback::ffn_hidden;
        } else if (a.act && a.down.quantized) {
            const int64_t g = a.down.act_group;
            const int down = lin_index(a.down);
            int8_t* q = codes(slot_of(down, LinSlot::in_q8), T * F);
            float* s = ar.get<float>(slot_of(down, LinSlot::in_s), T * (F / g));
            const Result r = swiglu_quant({gb, F}, {ub, F}, T, F, g, q, s);
            if (overflowed(r, s, T * (F / g))) return Fallback::ffn_hidden;
            di = Act{nullptr, q, s, g};
        } else {
            float* sb = ar.get<float>(slot_of(Slot::act_out), T * F);
            swiglu({gb, F}, {ub, F}, T, F, sb, F);
            di = Act{sb, nullptr, nullptr, 0};
        }
        project_add(a.down, di, x1, a.ffn_post_norm, a.out);
        for (int64_t i = 0; i < T * H; ++i) {
            if ((f32_bits(a.out[i]) & 0x7f800000u) == 0x7f800000u) return Fallback::non_finite_output;
        }
        return Fallback::none;
    }
};

// ---- Python side: read the runtime's objects ------------------------------------------

// Interned attribute names (keyed by the address of the string literal): no string is
// created or hashed per lookup.
PyObject* interned(const char* name) {
    static std::vector<std::pair<const char*, PyObject*>> names;
    for (const auto& e : names) {
        if (e.first == name) return e.second;
    }
    PyObject* s = PyUnicode_InternFromString(name);
    if (s == nullptr) throw py::error_already_set();
    names.emplace_back(name, s);  // kept for the life of the process
    return s;
}

py::object get_opt(const py::handle& o, const char* name) {  // None when missing
    PyObject* v = PyObject_GetAttr(o.ptr(), interned(name));
    if (v == nullptr) {
        PyErr_Clear();
        return py::none();
    }
    return py::reinterpret_steal<py::object>(v);
}

py::object get(const py::handle& o, const char* name) {
    PyObject* v = PyObject_GetAttr(o.ptr(), interned(name));
    if (v == nullptr) {
        PyErr_Clear();
        throw py::type_error(std::string("decoder_layer: ") + py::str(py::type::of(o)).cast<std::string>() +
                             " has no attribute '" + name + "'");
    }
    return py::reinterpret_steal<py::object>(v);
}

// An optional attribute (contexts built before it existed lack it): None when absent.
py::object get_or_none(const py::handle& o, const char* name) {
    PyObject* v = PyObject_GetAttr(o.ptr(), interned(name));
    if (v == nullptr) {
        PyErr_Clear();
        return py::none();
    }
    return py::reinterpret_steal<py::object>(v);
}

bool is_f32(const py::array& a) {
    return a.dtype().kind() == 'f' && a.itemsize() == 4 && a.dtype().byteorder() != '>';
}

[[noreturn]] void bad(const std::string& m) { throw py::value_error("decoder_layer: " + m); }

const float* f32_vec(const py::object& o, int64_t n, const char* what, std::vector<py::object>& keep) {
    if (!py::isinstance<py::array>(o)) throw py::type_error(std::string("decoder_layer: ") + what + " must be a numpy array");
    py::array a = py::reinterpret_borrow<py::array>(o);
    if (!is_f32(a)) throw py::type_error(std::string("decoder_layer: ") + what + " must be float32");
    if (a.ndim() != 1 || a.shape(0) != n || !(a.flags() & py::array::c_style)) {
        bad(std::string(what) + " must be a contiguous [" + std::to_string(n) + "] vector");
    }
    keep.push_back(a);
    return static_cast<const float*>(a.data());
}

const WeightView* weight_of(const py::object& native, const std::string& name) {
    if (native.is_none()) throw py::type_error("decoder_layer: " + name + " has no native Weight bound (call bind first)");
    try {
        return &native.cast<const Weight&>().view;
    } catch (const py::cast_error&) {
        throw py::type_error("decoder_layer: " + name + ".native is not a _kernels.Weight");
    }
}

Lin linear_of(const py::object& lin, const char* what, int64_t N, int64_t K, std::vector<py::object>& keep) {
    Lin l;
    const std::string name = what;
    const py::object factors = get(lin, "factors");
    if (!factors.is_none()) {
        py::tuple f = factors.cast<py::tuple>();
        if (f.size() != 2) bad(name + ".factors must be (U, V)");
        l.u = weight_of(get(f[0], "native"), name + ".factors[0]");
        l.v = weight_of(get(f[1], "native"), name + ".factors[1]");
        if (l.u->N != N || l.v->K != K || l.u->K != l.v->N) bad(name + " low-rank factor shapes do not make [" + std::to_string(N) + ", " + std::to_string(K) + "]");
        keep.push_back(factors);
    } else {
        l.w = weight_of(get(lin, "native"), name);
        if (l.w->N != N || l.w->K != K) {
            bad(name + " is [" + std::to_string(l.w->N) + ", " + std::to_string(l.w->K) + "], expected [" + std::to_string(N) + ", " + std::to_string(K) + "]");
        }
        keep.push_back(get(lin, "native"));
    }
    const py::object b = get(lin, "bias");
    if (!b.is_none()) l.bias = f32_vec(b, N, (name + ".bias").c_str(), keep);
    l.quantized = get(lin, "is_quantized").cast<bool>();
    l.act_group = get(lin, "act_group").cast<int64_t>();
    if (l.quantized && (l.act_group < 1 || K % l.act_group != 0)) bad(name + ".act_group must divide " + std::to_string(K));
    if (l.quantized && l.w != nullptr && l.w->enc != WEnc::i8) {
        const int64_t lo = std::min(l.act_group, l.w->group), hi = std::max(l.act_group, l.w->group);
        if (hi % lo != 0) bad(name + ".act_group and the weight group must divide one another");
    }
    if (l.quantized && l.w != nullptr && (l.w->enc == WEnc::f32 || l.w->enc == WEnc::f16 || l.w->enc == WEnc::bf16)) {
        bad(name + " is_quantized disagrees with its float encoding");
    }
    l.N = N;
    l.K = K;
    return l;
}

// ---- ctx.lora: checked per call, names built only for an error message -----------------

[[noreturn]] void bad_lora(const char* slot, const std::string& what) {
    bad(std::string("ctx.lora.pairs['") + slot + "']." + what);
}

[[noreturn]] void bad_lora_type(const char* slot, const std::string& what) {
    throw py::type_error(std::string("decoder_layer: ctx.lora.pairs['") + slot + "']." + what);
}

// A C-contiguous little-endian 2-D array [rows, cols] (0: any size >= 1).
py::array lora_array(const py::object& o, int64_t rows, int64_t cols, const char* slot, const char* what) {
    if (!py::isinstance<py::array>(o)) bad_lora_type(slot, std::string(what) + " must be a numpy array");
    py::array m = py::reinterpret_borrow<py::array>(o);
    if (m.ndim() != 2 || m.shape(0) < 1 || m.shape(1) < 1 || (rows > 0 && m.shape(0) != rows) ||
        (cols > 0 && m.shape(1) != cols) || !(m.flags() & py::array::c_style) || m.dtype().byteorder() == '>') {
        auto dim = [](int64_t d) { return d > 0 ? std::to_string(d) : std::string("r"); };
        bad_lora(slot, std::string(what) + " must be a contiguous [" + dim(rows) + ", " + dim(cols) + "] array");
    }
    return m;
}

// float32 [n] (a factor's per-row scales).
const float* lora_scales(const py::object& o, int64_t n, const char* slot, const char* what,
                         std::vector<py::object>& keep) {
    if (!py::isinstance<py::array>(o)) bad_lora_type(slot, std::string(what) + " must be a numpy array");
    py::array v = py::reinterpret_borrow<py::array>(o);
    if (!is_f32(v) || v.ndim() != 1 || v.shape(0) != n || !(v.flags() & py::array::c_style)) {
        bad_lora(slot, std::string(what) + " must be a contiguous float32 [" + std::to_string(n) + "] vector");
    }
    keep.push_back(v);
    return static_cast<const float*>(v.data());
}

// A (format.adapter.LoraFactor [r, K] as stored) as a WeightView: int8 codes with float32
// per-row scales, or float16 / float32 codes.
WeightView lora_down(const py::object& f, int64_t K, const char* slot, std::vector<py::object>& keep) {
    py::array codes = lora_array(get(f, "codes"), 0, K, slot, "a.codes");
    WeightView w;
    w.N = codes.shape(0);
    w.K = K;
    w.codes = codes.data();
    keep.push_back(codes);
    const char kind = codes.dtype().kind();
    const auto size = codes.itemsize();
    if (kind == 'i' && size == 1) {
        w.enc = WEnc::i8;
        w.group = K;
        w.scales_f32 = lora_scales(get(f, "scales"), w.N, slot, "a.scales", keep);
    } else if (kind == 'f' && size == 2) {
        w.enc = WEnc::f16;
    } else if (kind == 'f' && size == 4) {
        w.enc = WEnc::f32;
    } else {
        bad_lora_type(slot, "a.codes must be int8, float16 or float32");
    }
    return w;
}

// B^T (LoraPair.b_t [r, N], b_scales): int8 codes with per-output scales, or float32.
LoraUp lora_up_of(const py::object& pair, int64_t r, int64_t N, const char* slot, std::vector<py::object>& keep) {
    py::array codes = lora_array(get(pair, "b_t"), r, N, slot, "b_t");
    keep.push_back(codes);
    LoraUp b;
    b.codes = codes.data();
    b.r = r;
    b.N = N;
    const py::object scales = get(pair, "b_scales");
    if (codes.dtype().kind() == 'i' && codes.itemsize() == 1) {
        b.scales = lora_scales(scales, N, slot, "b_scales", keep);
    } else if (!is_f32(codes) || !scales.is_none()) {
        bad_lora_type(slot, "b_t must be int8 (with b_scales) or float32 (b_scales None)");
    }
    return b;
}

// ctx.lora (runtime_shim.adapters.LayerLora, or None): its pairs by slot name, and scale.
void bind_lora(const py::object& lora, LayerArgs& a, std::vector<py::object>& keep) {
    if (lora.is_none()) return;
    const double scale = get(lora, "scale").cast<double>();
    if (!std::isfinite(scale)) bad("ctx.lora.scale must be finite");
    const py::object pairs_o = get(lora, "pairs");
    if (!PyDict_Check(pairs_o.ptr())) throw py::type_error("decoder_layer: ctx.lora.pairs must be a dict");
    keep.push_back(pairs_o);
    const std::pair<const char*, Lin*> slots[] = {{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"o", &a.o},
                                                  {"gate", &a.gate}, {"up", &a.up}, {"down", &a.down}};
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(pairs_o.ptr(), &pos, &key, &value)) {  // one pass: no key strings made
        if (!PyUnicode_Check(key)) continue;
        for (const auto& [slot, lin] : slots) {
            if (PyUnicode_CompareWithASCIIString(key, slot) != 0) continue;
            const py::handle pair(value);
            lin->lora_a = lora_down(get(pair, "a"), lin->K, slot, keep);
            const int64_t r = lin->lora_a.N;
            lin->lora_b = lora_up_of(py::reinterpret_borrow<py::object>(pair), r, lin->N, slot, keep);
            const double s = scale * get(pair, "scale").cast<double>();  // as LoraPair.delta: one rounding
            if (!std::isfinite(s)) bad_lora(slot, "scale times ctx.lora.scale must be finite");
            lin->lora_scale = static_cast<float>(s);
            lin->rank = r;
            break;
        }
    }
}

int64_t group_attr(const py::object& lw, const char* name, int64_t H) {
    const py::object g = get(lw, name);
    if (g.is_none()) return 0;
    const int64_t v = g.cast<int64_t>();
    if (v < 1 || H % v != 0) bad(std::string(name) + " must divide the hidden size");
    return v;
}

// The call-wide arguments of ctx (input, heads, positions, RoPE rows, activation, score
// scale and cap), the same for every layer of one forward, read and validated into `a`
// (`keep` holds every array `a` points into).
void parse_call(const py::object& x_in, const py::object& ctx, CallArgs& a, std::vector<py::object>& keep) {
    if (!py::isinstance<py::array>(x_in)) throw py::type_error("decoder_layer: x must be a numpy array");
    py::array x = py::reinterpret_borrow<py::array>(x_in);
    if (!is_f32(x)) throw py::type_error("decoder_layer: x must be float32");
    if (x.ndim() != 2 || !(x.flags() & py::array::c_style) || x.shape(0) < 1 || x.shape(1) < 1) {
        bad("x must be a C-contiguous [T, hidden] array");
    }
    a.T = x.shape(0);
    a.hidden = x.shape(1);
    a.x = static_cast<const float*>(x.data());
    a.nh = get(ctx, "num_heads").cast<int64_t>();
    a.nkv = get(ctx, "num_kv_heads").cast<int64_t>();
    a.hd = get(ctx, "head_dim").cast<int64_t>();
    const double eps = get(ctx, "eps").cast<double>();
    if (a.nh < 1 || a.nkv < 1 || a.nh % a.nkv != 0 || a.hd < 2 || a.hd % 2 != 0) bad("bad head configuration");
    if (!(eps >= 0.0) || !std::isfinite(eps)) bad("eps must be finite and >= 0");
    a.eps = static_cast<float>(eps);
    a.act = get(ctx, "act_int8").cast<bool>();
    // positions: consecutive from start; n_ctx = start + T
    py::array pos = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(get(ctx, "positions"));
    if (!pos || pos.ndim() != 1 || pos.shape(0) != a.T) bad("ctx.positions must be [T] integers");
    const auto* pp = static_cast<const int64_t*>(pos.data());
    a.start = pp[0];
    for (int64_t t = 0; t < a.T; ++t) {
        if (pp[t] != a.start + t) bad("ctx.positions must be consecutive");
    }
    if (a.start < 0) bad("positions must be >= 0");
    if (get(ctx, "n_ctx").cast<int64_t>() != a.start + a.T) bad("ctx.n_ctx must equal positions[-1] + 1");
    const int64_t half = a.hd / 2;
    for (const char* name : {"cos", "sin"}) {
        py::object o = get(ctx, name);
        if (!py::isinstance<py::array>(o)) throw py::type_error(std::string("decoder_layer: ctx.") + name + " must be a numpy array");
        py::array c = py::reinterpret_borrow<py::array>(o);
        if (!is_f32(c)) throw py::type_error(std::string("decoder_layer: ctx.") + name + " must be float32");
        if (c.ndim() != 2 || c.shape(0) != a.T || c.shape(1) != half || !(c.flags() & py::array::c_style)) {
            bad(std::string("ctx.") + name + " must be a contiguous [T, head_dim/2] array");
        }
        (name[0] == 'c' ? a.cos : a.sin) = static_cast<const float*>(c.data());
        keep.push_back(c);
    }
    const py::object act_o = get_opt(ctx, "activation");
    const std::string act = act_o.is_none() ? "silu" : act_o.cast<std::string>();
    if (act == "gelu") {
        a.act_kind = static_cast<int>(GatedAct::gelu);
    } else if (act == "gelu_tanh") {
        a.act_kind = static_cast<int>(GatedAct::gelu_tanh);
    } else if (act == "relu") {
        a.act_kind = static_cast<int>(GatedAct::relu);
    } else if (act != "silu") {
        bad("unknown activation '" + act + "'");
    }
    const py::object sc = get_opt(ctx, "attn_scale"), cap = get_opt(ctx, "attn_softcap");
    if (!sc.is_none()) {
        a.attn_scale = sc.cast<double>();
        if (!(a.attn_scale > 0.0) || !std::isfinite(a.attn_scale)) bad("ctx.attn_scale must be finite and > 0");
    }
    if (!cap.is_none()) {
        a.softcap = static_cast<float>(cap.cast<double>());
        if (!(a.softcap > 0.0f) || !std::isfinite(a.softcap)) bad("ctx.attn_softcap must be finite and > 0");
    }
}

// One layer's KV cache arrays (kvo; no block table yet) and sliding window, or kv_layout
// when the native kernels lack the cache's layout.
Fallback parse_kv_arrays(const py::object& kvo, const py::object& win, LayerArgs& a, std::vector<py::object>& keep) {
    // KV cache (validated by the same code as attention_prefill)
    const std::string mode = get(kvo, "mode").cast<std::string>();
    // The layouts implemented here (runtime_shim.kv_cache.KV_LAYOUTS marks them native):
    // anything else is the caller's to run, said with a typed reason, never approximated.
    const bool v5 = mode == "int8-v5", v6 = mode == "int8";
    if (mode != "float") {
        const int64_t g = get(kvo, "v_group").cast<int64_t>();
        if (!(v5 || v6 || mode == "int8-legacy") || g < 8 || g % 8 != 0 || a.hd % g != 0) {
            return Fallback::kv_layout;
        }
    }
    const py::object layout = get_opt(kvo, "layout");
    const bool rotate = !layout.is_none() && get_opt(layout, "rotate").is(py::bool_(true));
    KvHandle kvh = kv_arrays_from(get(kvo, "k"), get(kvo, "k_scales"), get(kvo, "v"), get(kvo, "v_scales"),
                                  v5 || v6 ? get(kvo, "v_high") : py::none(), v5 ? get(kvo, "v_mins") : py::none(),
                                  rotate);
    a.kv = kvh.kv;
    keep.insert(keep.end(), kvh.keep.begin(), kvh.keep.end());
    if (a.kv.n_kv_heads != a.nkv || a.kv.head_dim != a.hd) bad("the KV cache heads / head_dim do not match ctx");
    if (!win.is_none()) {
        a.window = win.cast<int64_t>();
        if (a.window < 1) bad("ctx.window must be >= 1");
    }
    return Fallback::none;
}

// One layer's KV cache (kvo over the block table) and sliding window, or kv_layout when
// the native kernels lack the cache's layout.
Fallback parse_kv(const py::object& kvo, const py::object& table, const py::object& win, LayerArgs& a,
                  std::vector<py::object>& keep) {
    const Fallback reason = parse_kv_arrays(kvo, win, a, keep);
    if (reason == Fallback::none) keep.push_back(bind_block_table(a.kv, table, a.start + a.T));
    return reason;
}

// A layer's weights, checked against the hidden size and heads already in `a`.
void parse_weights(const py::object& lw, LayerArgs& a, std::vector<py::object>& keep) {
    // weights
    const int64_t H = a.hidden, QD = a.nh * a.hd, KD = a.nkv * a.hd;
    a.attn_norm = f32_vec(get(lw, "attn_norm"), H, "attn_norm", keep);
    a.ffn_norm = f32_vec(get(lw, "ffn_norm"), H, "ffn_norm", keep);
    a.q = linear_of(get(lw, "q"), "q", QD, H, keep);
    a.k = linear_of(get(lw, "k"), "k", KD, H, keep);
    a.v = linear_of(get(lw, "v"), "v", KD, H, keep);
    a.o = linear_of(get(lw, "o"), "o", H, QD, keep);
    const py::object gate = get(lw, "gate");
    const int64_t F = get(gate, "rows").cast<int64_t>();
    if (F < 1) bad("gate.rows must be >= 1");
    a.ffn = F;
    a.gate = linear_of(gate, "gate", F, H, keep);
    a.up = linear_of(get(lw, "up"), "up", F, H, keep);
    a.down = linear_of(get(lw, "down"), "down", H, F, keep);
    // what the Llama family varies (None or missing: the plain Llama layer)
    const py::object qn = get_opt(lw, "q_norm"), kn = get_opt(lw, "k_norm");
    if (!qn.is_none() && !kn.is_none()) {
        a.q_norm = f32_vec(qn, a.hd, "q_norm", keep);
        a.k_norm = f32_vec(kn, a.hd, "k_norm", keep);
    }
    const py::object apn = get_opt(lw, "attn_post_norm"), fpn = get_opt(lw, "ffn_post_norm");
    if (!apn.is_none()) a.attn_post_norm = f32_vec(apn, H, "attn_post_norm", keep);
    if (!fpn.is_none()) a.ffn_post_norm = f32_vec(fpn, H, "ffn_post_norm", keep);
    a.qkv_group = group_attr(lw, "qkv_group", H);
    a.gate_up_group = group_attr(lw, "gate_up_group", H);
    if (a.qkv_group > 0 && !(a.q.quantized && a.k.quantized && a.v.quantized)) bad("qkv_group set but q/k/v are not all quantized");
    if (a.gate_up_group > 0 && !(a.gate.quantized && a.up.quantized)) bad("gate_up_group set but gate/up are not both quantized");
}

// The plan for a T-token call in ctx.arena, the model's planned buffer (None: unplanned,
// each buffer in its own region).
struct PlannedArena {
    const ArenaPlan* plan = nullptr;
    uint8_t* base = nullptr;
};

PlannedArena arena_of(const py::object& ctx, int64_t T) {
    const py::object arena_o = get_opt(ctx, "arena");
    if (arena_o.is_none()) return {};
    const LayerArena& arena = arena_o.cast<const LayerArena&>();
    const ArenaPlan* plan = arena.plan_for(T);
    if (plan == nullptr) {
        bad("ctx.arena is planned for at most " + std::to_string(arena.max_tokens()) + " tokens, not " + std::to_string(T));
    }
    return {plan, arena.base()};
}

Fallback run_layer(const LayerArgs& a, const PlannedArena& arena, Result& kv_error);

// The call's arguments read and validated from the runtime's objects into `a` (`keep` holds
// every array `a` points into), or why the native layer cannot take the call (kv_layout).
Fallback parse_layer(const py::object& lw, const py::object& x_in, const py::object& ctx, LayerArgs& a,
                     std::vector<py::object>& keep) {
    parse_call(x_in, ctx, a, keep);
    const Fallback kv = parse_kv(get(ctx, "kv"), get(ctx, "block_table"), get_opt(ctx, "window"), a, keep);
    if (kv != Fallback::none) return kv;
    parse_weights(lw, a, keep);
    bind_lora(get_or_none(ctx, "lora"), a, keep);
    return Fallback::none;
}

py::tuple decoder_layer(const py::object& lw, const py::object& x_in, const py::object& ctx) {
    std::vector<py::object> keep;
    LayerArgs a;
    const Fallback unsupported = parse_layer(lw, x_in, ctx, a, keep);
    if (unsupported != Fallback::none) return py::make_tuple(py::none(), fallback_reason(unsupported));
    const int64_t H = a.hidden;
    const PlannedArena arena = arena_of(ctx, a.T);
    py::array out(py::dtype::of<float>(), std::vector<py::ssize_t>{a.T, H});
    a.out = static_cast<float*>(out.mutable_data());
    Fallback reason = Fallback::none;
    Result kv_error;
    {
        py::gil_scoped_release nogil;
        reason = run_layer(a, arena, kv_error);
    }
    if (reason == Fallback::none) return py::make_tuple(out, py::none());
    if (kv_error.status != Status::ok) raise_numeric(kv_error, "decoder_layer", kv_where(kv_error, a.nkv));
    if (reason == Fallback::non_finite_output) return py::make_tuple(out, fallback_reason(reason));
    return py::make_tuple(py::none(), fallback_reason(reason));
}

// ---- the whole forward in one call ----------------------------------------------------

// One parsed layer on the pool (call without the GIL): its buffers in the planned arena,
// and its Runner.
Fallback run_layer(const LayerArgs& a, const PlannedArena& arena, Result& kv_error) {
    Arena ar{arena.plan, arena.base};
    Runner r{a, ar, {}, {}, {}};
    const Fallback reason = r.run();
    kv_error = r.kv_error;
    return reason;
}

// logits [rows, N] = head(x) of `rows` final-normed rows, as the runtime's own head
// computes it (int8 activations in the head's group when `act`); false when that
// quantization overflows (the caller's head records the fallback and runs on float
// activations). The head runs as the `down` linear of an otherwise empty layer, its
// buffers unplanned (their own per-thread regions: the arena plans the layers only).
bool run_head(const Lin& head, bool act, const float* x, int64_t rows, float* logits) {
    LayerArgs h;
    h.T = rows;
    h.act = act;
    h.down = head;
    Arena ar{};
    Runner r{h, ar, {}, {}, {}};
    Act in;
    if (!r.input_for(h.down, x, head.K, &in)) return false;
    r.apply(h.down, in, logits, nullptr);
    return true;
}

// Runs the parsed layers args[0, parsed) in turn on args[0].x (no GIL), then, when they
// are all n, the final RMSNorm and the head of the last `rows` rows (their argmax into
// `picks` when given): Stack.run's result. `reason`: why layer `parsed` (< n) cannot run
// natively.
py::tuple run_stack(std::vector<LayerArgs>& args, std::vector<float>& other, const PlannedArena& arena, int64_t parsed,
                    int64_t n, Fallback reason, const float* normw, float eps, const Lin* head, int64_t rows,
                    int64_t* picks) {
    const int64_t T = args[0].T, H = args[0].hidden;
    py::array out(py::dtype::of<float>(), std::vector<py::ssize_t>{T, H});
    float* outp = static_cast<float*>(out.mutable_data());
    py::array logits;
    if (head != nullptr) logits = py::array(py::dtype::of<float>(), std::vector<py::ssize_t>{rows, head->N});
    float* lp = head != nullptr ? static_cast<float*>(logits.mutable_data()) : nullptr;
    // layers alternate between `out` and a second buffer: the planned slot stack_x, else
    // `other` (grown, never zero-filled: each layer writes all of its output); the final
    // norm runs in place when the last layer wrote `out`
    const int xs = slot_of(Slot::stack_x);
    float* second = nullptr;
    if (arena.plan != nullptr && arena.plan->size[xs] >= T * H * static_cast<int64_t>(sizeof(float))) {
        second = reinterpret_cast<float*>(arena.base + arena.plan->offset[xs]);
    } else {
        if (other.size() < static_cast<size_t>(T * H)) other.resize(static_cast<size_t>(T * H));
        second = other.data();
    }
    int64_t done = 0;
    bool head_ok = false;
    {
        py::gil_scoped_release nogil;
        const float* cur = args[0].x;
        for (; done < parsed; ++done) {
            LayerArgs& a = args[done];
            a.x = cur;
            a.out = done % 2 == 0 ? second : outp;
            Result kv_error;
            const Fallback r = run_layer(a, arena, kv_error);
            if (r != Fallback::none) {
                reason = r;  // the caller reruns this layer from its input and handles r
                break;
            }
            cur = a.out;
        }
        if (done == n) {
            rmsnorm({cur, H}, normw, T, H, eps, outp, H);
            if (head != nullptr) head_ok = run_head(*head, args[0].act, outp + (T - rows) * H, rows, lp);
            if (head_ok && picks != nullptr) argmax_rows(lp, rows, head->N, picks);
        } else if (cur != outp) {
            std::copy(cur, cur + T * H, outp);
        }
    }
    if (done < n) return py::make_tuple(out, done, fallback_reason(reason), py::none());
    return py::make_tuple(out, done, py::none(), head_ok ? py::object(logits) : py::none());
}

const float* final_norm(const py::object& norm, double eps, int64_t H, std::vector<py::object>& keep) {
    if (!(eps >= 0.0) || !std::isfinite(eps)) bad("eps must be finite and >= 0");
    return f32_vec(norm, H, "norm", keep);
}

Lin head_of(const py::object& head, int64_t H, std::vector<py::object>& keep) {
    const int64_t rows = get(head, "rows").cast<int64_t>();
    if (rows < 1) bad("head.rows must be >= 1");
    return linear_of(head, "head", rows, H, keep);
}

// The whole forward of a chunk in one call.  Stack(layers, ctx, norm, eps, head) reads and
// validates every layer's weights once (against ctx's heads; hidden size: norm's) and keeps
// them (the runtime's weights are fixed at open).  run(x, ctx, kvs, windows, head, loras, rows,
// picks) -> (x, done, reason, logits) reads only the call: ctx's call-wide fields once, each
// layer's KV cache and window, then runs layer i on layer i-1's output, the final RMSNorm and
// the head of the last `rows` rows with the GIL released once.  done == len(layers): x is the
// final-normed hidden state [T, hidden] and logits the head's [rows, N] (None without a head
// or when its input overflows int8), each row's argmax in `picks` when given (a greedy
// verify pass needs no more).  done < len(layers): layer `done` gave `reason` (or cannot run
// natively: kv_layout) and x is that layer's input; the caller runs the rest itself
// (runtime_shim's per-layer chain is the reference).  loras[i] is layer i's adapter
// (runtime_shim.adapters.LayerLora or None), read per call: a session picks its adapter.
struct Stack {
    std::vector<LayerArgs> layers;  // the weight fields of each layer (parse_weights)
    std::vector<py::object> keep;
    // Each layer's KV cache arrays and window as last parsed, kept while run is given the
    // same objects (the runtime's LayerKV views are frozen, over a pool's fixed arrays, and
    // its windows a fixed list): a decode step then reads no attribute of them, only the
    // call's block table, checked once against every layer's cache.
    struct KvSlot {
        py::object kvo, win;  // the objects parsed (kept: their identity stays theirs)
        KvCache kv;
        int64_t window = 0;
        Fallback reason = Fallback::none;
        std::vector<py::object> keep;
    };
    std::vector<KvSlot> kv_slots;
    const float* norm = nullptr;
    float eps = 0.0f;
    Lin head;
    bool has_head = false;
    int64_t hidden = 0, nh = 0, nkv = 0, hd = 0;
    // A call's copy of the layers' fields and its second [T, hidden] buffer (when the arena
    // plans none), kept for the next call (no allocation per decode step); a call made while
    // another runs on this Stack (the GIL is released while the layers run) takes its own.
    struct CallBuffers {
        std::vector<LayerArgs> args;
        std::vector<float> other;
    };
    CallBuffers reuse;
    std::mutex reuse_mutex;

    Stack(const py::sequence& lws, const py::object& ctx, const py::object& norm_in, double eps_in,
          const py::object& head_in) {
        const int64_t n = static_cast<int64_t>(py::len(lws));
        if (n < 1) bad("Stack needs >= 1 layer");
        hidden = py::len(norm_in);
        LayerArgs shape;
        shape.hidden = hidden;
        shape.nh = nh = get(ctx, "num_heads").cast<int64_t>();
        shape.nkv = nkv = get(ctx, "num_kv_heads").cast<int64_t>();
        shape.hd = hd = get(ctx, "head_dim").cast<int64_t>();
        if (nh < 1 || nkv < 1 || nh % nkv != 0 || hd < 2 || hd % 2 != 0) bad("bad head configuration");
        layers.assign(static_cast<size_t>(n), shape);
        for (int64_t i = 0; i < n; ++i) parse_weights(lws[i], layers[i], keep);
        norm = final_norm(norm_in, eps_in, hidden, keep);
        eps = static_cast<float>(eps_in);
        has_head = !head_in.is_none();
        if (has_head) head = head_of(head_in, hidden, keep);
    }

    py::tuple run(const py::object& x_in, const py::object& ctx, const py::sequence& kvs, const py::sequence& windows,
                  bool with_head, const py::object& loras_in, int64_t rows, const py::object& picks_in) {
        const int64_t n = static_cast<int64_t>(layers.size());
        if (static_cast<int64_t>(py::len(kvs)) != n || static_cast<int64_t>(py::len(windows)) != n) {
            bad("Stack.run needs a KV cache and a window per layer");
        }
        if (loras_in.is_none() && !get_or_none(ctx, "lora").is_none()) bad("Stack.run takes adapters as loras, one per layer");
        py::sequence loras;
        if (!loras_in.is_none()) {
            loras = py::reinterpret_borrow<py::sequence>(loras_in);
            if (static_cast<int64_t>(py::len(loras)) != n) bad("Stack.run needs an adapter layer (or None) per layer");
        }
        std::vector<py::object> call_keep;
        CallArgs call;
        parse_call(x_in, ctx, call, call_keep);
        if (call.hidden != hidden || call.nh != nh || call.nkv != nkv || call.hd != hd) {
            bad("x / ctx do not match the Stack's hidden size and heads");
        }
        if (rows < 1 || rows > call.T) bad("Stack.run: rows must be in [1, T]");
        int64_t* picks = nullptr;
        if (!picks_in.is_none()) {
            if (!py::isinstance<py::array>(picks_in)) throw py::type_error("Stack.run: picks must be a numpy array");
            py::array p = py::reinterpret_borrow<py::array>(picks_in);
            if (!p.dtype().is(py::dtype::of<int64_t>()) || p.ndim() != 1 || p.shape(0) != rows ||
                !(p.flags() & py::array::c_style) || !p.writeable()) {
                bad("Stack.run: picks must be a writeable contiguous int64 [rows] array");
            }
            picks = static_cast<int64_t*>(p.mutable_data());
            call_keep.push_back(p);
        }
        const py::object table = get(ctx, "block_table");
        std::unique_lock<std::mutex> mine(reuse_mutex, std::try_to_lock);
        CallBuffers own;
        CallBuffers& buf = mine.owns_lock() ? reuse : own;
        std::vector<LayerArgs>& args = buf.args;
        args = layers;  // (the same size each call: no allocation)
        kv_slots.resize(static_cast<size_t>(n));
        int64_t parsed = 0;
        Fallback reason = Fallback::none;
        KvCache checked;  // the geometry the block table was last checked against
        for (; parsed < n; ++parsed) {
            LayerArgs& a = args[parsed];
            static_cast<CallArgs&>(a) = call;
            reason = kv_of(parsed, kvs[parsed], windows[parsed], a, call_keep);
            if (reason != Fallback::none) break;
            if (parsed == 0 || a.kv.n_blocks != checked.n_blocks || a.kv.block_size != checked.block_size) {
                call_keep.push_back(bind_block_table(a.kv, table, a.start + a.T));
                checked = a.kv;
            } else {
                a.kv.table = checked.table;
                a.kv.table_len = checked.table_len;
            }
            if (!loras_in.is_none()) bind_lora(loras[parsed], a, call_keep);
        }
        if (parsed == 0) return py::make_tuple(x_in, 0, fallback_reason(reason), py::none());
        return run_stack(args, buf.other, arena_of(ctx, call.T), parsed, n, reason, norm, eps,
                         with_head && has_head ? &head : nullptr, rows, picks);
    }

    // Layer i's KV cache arrays and window into `a` (no block table): the cached parse
    // when kvo and win are the objects it was made from, else parsed and cached.
    Fallback kv_of(int64_t i, const py::object& kvo, const py::object& win, LayerArgs& a,
                  std::vector<py::object>& call_keep) {
        KvSlot& slot = kv_slots[static_cast<size_t>(i)];
        if (!slot.kvo || !slot.kvo.is(kvo) || !slot.win.is(win)) {
            slot = KvSlot{};
            slot.reason = parse_kv_arrays(kvo, win, a, slot.keep);
            slot.kv = a.kv;
            slot.window = a.window;
            slot.kvo = kvo;
            slot.win = win;
        }
        a.kv = slot.kv;
        a.window = slot.window;
        call_keep.push_back(slot.kvo);  // its arrays live while this call runs, whatever the slot holds next
        return slot.reason;
    }

};

}  // namespace

void bind_layer(py::module_& m) {
    py::dict reasons;
    for (const Fallback f : kFallbacks) reasons[py::int_(static_cast<int32_t>(f))] = fallback_reason(f);
    m.attr("FALLBACK_REASONS") = reasons;
    m.attr("DECODER_LAYER_LORA") = true;  // reads ctx.lora (runtime_shim.adapters.LayerLora)
    bind_layer_arena(m);
    m.def("decoder_layer", &decoder_layer, py::arg("lw"), py::arg("x"), py::arg("ctx"),
          "One Llama decoder layer (runtime_shim LayerWeights / LayerContext) in one call: "
          "returns (x_out | None, fallback_reason | None).");
    py::class_<Stack>(m, "Stack",
                      "The whole forward in one call over weights read once (layers, ctx for the heads, norm, eps, head).")
        .def(py::init<const py::sequence&, const py::object&, const py::object&, double, const py::object&>(),
             py::arg("layers"), py::arg("ctx"), py::arg("norm"), py::arg("eps"), py::arg("head") = py::none())
        .def("run", &Stack::run, py::arg("x"), py::arg("ctx"), py::arg("kvs"), py::arg("windows"),
             py::arg("head") = true, py::arg("loras") = py::none(), py::arg("rows") = 1, py::arg("picks") = py::none(),
             "Every layer (kvs[i], windows[i], loras[i]; ctx's own kv / window / lora unused), the final norm and "
             "the head of the last `rows` rows: (x, layers_done, fallback_reason | None, logits [rows, N] | None); "
             "picks (int64 [rows]) gets each logits row's argmax (numpy's: first maximum, or first NaN).");
}

}  // namespace infer
}  // namespace edgepack
