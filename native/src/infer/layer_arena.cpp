// LayerArena: the planned activation buffer of decoder_layer (layer_arena.h).
#include "layer_arena.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <stdexcept>

namespace py = pybind11;

namespace edgepack {
namespace infer {

namespace {

const char* const kLayerSlotNames[] = {"attn_h", "attn_q8", "attn_s", "q_out", "k_out", "v_out",
                                       "att", "attn_post", "x1", "ffn_h", "ffn_q8", "ffn_s",
                                       "gate_out", "up_out", "act_out", "ffn_post", "q_rot", "k_rot", "v_rot",
                                       "stack_x"};
static_assert(sizeof(kLayerSlotNames) / sizeof(kLayerSlotNames[0]) == static_cast<size_t>(Slot::linears),
              "one name per layer slot");
const char* const kLinearNames[kLinears] = {"q", "k", "v", "o", "gate", "up", "down"};
const char* const kLinSlotNames[kLinSlots] = {"in_q8", "in_s", "in_f", "lora_x", "lora_h", "prep"};

int slot_index(const std::string& name) {
    for (int i = 0; i < kSlots; ++i) {
        if (slot_name(i) == name) return i;
    }
    throw py::value_error("LayerArena: unknown slot '" + name + "'");
}

}  // namespace

std::string slot_name(int slot) {
    const int first = static_cast<int>(Slot::linears);
    if (slot < first) return kLayerSlotNames[slot];
    const int l = (slot - first) / kLinSlots, s = (slot - first) % kLinSlots;
    return std::string(kLinearNames[l]) + "." + kLinSlotNames[s];
}

LayerArena::LayerArena(int64_t nbytes, const py::list& plans) : nbytes_(nbytes) {
    if (nbytes < 0) throw py::value_error("LayerArena: nbytes must be >= 0");
    for (const py::handle& p : plans) {
        const auto entry = p.cast<py::tuple>();
        if (entry.size() != 2) throw py::value_error("LayerArena: a plan is (tokens, {slot: (offset, size)})");
        ArenaPlan plan;
        plan.tokens = entry[0].cast<int64_t>();
        if (plan.tokens < 1) throw py::value_error("LayerArena: a plan's tokens must be >= 1");
        for (const auto& [key, value] : entry[1].cast<py::dict>()) {
            const std::string name = key.cast<std::string>();
            const int i = slot_index(name);
            const auto span = value.cast<std::pair<int64_t, int64_t>>();
            if (span.first < 0 || span.second < 0 || span.first % kArenaAlign != 0 || span.second > nbytes - span.first) {
                throw py::value_error("LayerArena: slot '" + name + "' is not a 64-byte aligned span inside the arena");
            }
            plan.offset[i] = span.first;
            plan.size[i] = span.second;
        }
        plans_.push_back(plan);
    }
    if (nbytes > 0) {
        const size_t rounded = (static_cast<size_t>(nbytes) + kArenaAlign - 1) & ~static_cast<size_t>(kArenaAlign - 1);
        base_ = static_cast<uint8_t*>(std::aligned_alloc(kArenaAlign, rounded));
        if (base_ == nullptr) throw std::bad_alloc();
    }
}

LayerArena::~LayerArena() { std::free(base_); }

const ArenaPlan* LayerArena::plan_for(int64_t T) const {
    const ArenaPlan* best = nullptr;
    for (const ArenaPlan& p : plans_) {
        if (p.tokens >= T && (best == nullptr || p.tokens < best->tokens)) best = &p;
    }
    return best;
}

int64_t LayerArena::max_tokens() const {
    int64_t m = 0;
    for (const ArenaPlan& p : plans_) m = std::max(m, p.tokens);
    return m;
}

void bind_layer_arena(py::module_& m) {
    py::tuple names(kSlots);
    for (int i = 0; i < kSlots; ++i) names[i] = slot_name(i);
    py::class_<LayerArena>(m, "LayerArena",
                           "The one activation buffer of decoder_layer (ctx.arena), allocated now, with "
                           "plans: [(tokens, {slot: (offset, size)})] from runtime_shim.memory_plan.")
        .def(py::init<int64_t, const py::list&>(), py::arg("nbytes"), py::arg("plans"))
        .def_property_readonly("nbytes", &LayerArena::nbytes)
        .def_property_readonly("max_tokens", &LayerArena::max_tokens)
        .def_property_readonly_static("SLOTS", [names](const py::object&) { return names; });
}

}  // namespace infer
}  // namespace edgepack
