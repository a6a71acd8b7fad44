// The decoder layer's activation buffers (slots) and the one arena they live in.
//
// runtime_shim.memory_plan assigns every slot an offset from the slots' lifetimes in the
// layer chain (runtime_shim.kernels.layer_buffers describes them, by the names below), once
// per token count planned for (a prefill chunk, one decode token).  LayerArena holds the
// buffer, allocated once at open, and those plans; decoder_layer takes each buffer at its
// slot's offset instead of growing a scratch buffer per call.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

namespace edgepack {
namespace infer {

// Buffers of the layer itself (stack_x: the one-call forward's second [T, hidden] buffer,
// which its layers' outputs alternate with), then kLinSlots per linear (q, k, v, o, gate,
// up, down).
enum class Slot : int {
    attn_h, attn_q8, attn_s, q_out, k_out, v_out, att, attn_post, x1,
    ffn_h, ffn_q8, ffn_s, gate_out, up_out, act_out, ffn_post, q_rot, k_rot, v_rot, stack_x, linears
};
// A linear's input quantized for it (codes, scales), dequantized (low-rank factors read
// floats), the adapter's float input and its [T, rank] product, and the int8 input laid
// out for the active kernels (their q8_prep: T * q8_prep_bytes bytes).
enum class LinSlot : int { in_q8, in_s, in_f, lora_x, lora_h, prep };
constexpr int kLinears = 7;
constexpr int kLinSlots = 6;
constexpr int kSlots = static_cast<int>(Slot::linears) + kLinears * kLinSlots;
static_assert(kSlots <= 64, "Arena tracks the slots taken in one 64-bit mask");

constexpr int slot_of(Slot s) { return static_cast<int>(s); }
constexpr int slot_of(int linear, LinSlot s) {
    return static_cast<int>(Slot::linears) + linear * kLinSlots + static_cast<int>(s);
}
// "q_out", "gate.in_q8", ...: the names the Python plan uses (LayerArena.SLOTS).
std::string slot_name(int slot);

constexpr int64_t kArenaAlign = 64;

// The offsets of one plan; a slot of size 0 is one the plan says this model never takes.
struct ArenaPlan {
    int64_t tokens = 0;  // the largest T the plan holds
    int64_t offset[kSlots] = {};
    int64_t size[kSlots] = {};
};

// The buffer and its plans (Python: _kernels.LayerArena(nbytes, plans)).  One layer call
// at a time uses it: the runtime serializes forward passes per model (Model.lock).
class __attribute__((visibility("hidden"))) LayerArena {
public:
    LayerArena(int64_t nbytes, const pybind11::list& plans);
    ~LayerArena();
    LayerArena(const LayerArena&) = delete;
    LayerArena& operator=(const LayerArena&) = delete;

    // The smallest plan holding T tokens (nullptr: none does).
    const ArenaPlan* plan_for(int64_t T) const;
    uint8_t* base() const { return base_; }
    int64_t nbytes() const { return nbytes_; }
    int64_t max_tokens() const;

private:
    uint8_t* base_ = nullptr;
    int64_t nbytes_ = 0;
    std::vector<ArenaPlan> plans_;
};

void bind_layer_arena(pybind11::module_& m);

}  // namespace infer
}  // namespace edgepack
