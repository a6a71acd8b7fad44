// Why a decoder layer's int8-activation result is recomputed with float activations, or
// (kv_layout) why the native layer cannot run it at all and the caller runs its own chain.
//
// The one definition of the fallback reasons: exported to Python as
// _kernels.FALLBACK_REASONS ({code: reason}); edgepack.runtime_shim.kernels.Fallback is its
// mirror (same codes, same strings) and tests/test_runtime_layer_chain.py checks them equal.
// Codes are stable: append, never renumber.
#pragma once

#include <cstdint>

namespace edgepack {
namespace infer {

enum class Fallback : int32_t {
    none = 0,
    attention_input = 1,    // activation scale overflow quantizing the attention input
    attention_output = 2,   // ... the attention output (o projection input)
    ffn_input = 3,          // ... the FFN input (gate/up)
    ffn_hidden = 4,         // ... the SwiGLU output (down input)
    head_input = 5,         // ... the final norm's output (head input; Python only)
    non_finite_kv = 6,      // K/V to be written to the cache are not finite
    non_finite_output = 7,  // the layer output is not finite (the output is kept)
    kv_layout = 8,          // the KV cache layout is not one the native kernels implement
};

constexpr Fallback kFallbacks[] = {
    Fallback::attention_input, Fallback::attention_output, Fallback::ffn_input, Fallback::ffn_hidden,
    Fallback::head_input,      Fallback::non_finite_kv,    Fallback::non_finite_output,
    Fallback::kv_layout,
};

inline const char* fallback_reason(Fallback f) {
    switch (f) {
        case Fallback::none: return "";
        case Fallback::attention_input: return "activation scale overflow (attention input)";
        case Fallback::attention_output: return "activation scale overflow (attention output)";
        case Fallback::ffn_input: return "activation scale overflow (FFN input)";
        case Fallback::ffn_hidden: return "activation scale overflow (FFN hidden)";
        case Fallback::head_input: return "activation scale overflow (head input)";
        case Fallback::non_finite_kv: return "non-finite K/V";
        case Fallback::non_finite_output: return "non-finite layer output";
        case Fallback::kv_layout: return "KV cache layout not in the native kernels";
    }
    return "";
}

}  // namespace infer
}  // namespace edgepack
