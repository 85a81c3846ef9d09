// Expert engine: pinning of the host experts (page-locked for the GPU's uploads). See engine/engine.h.
#include "engine/engine.h"

namespace ost {

void unpin(pinned_t & p) {
    if (p.reg && !p.ptrs.empty()) {
        auto fn = (void (*)(void *)) ggml_backend_reg_get_proc_address(p.reg, "ggml_backend_unregister_host_buffer");
        const bool had_env = std::getenv("GGML_CUDA_REGISTER_HOST") != nullptr;   // see pin_experts
        if (!had_env) setenv("GGML_CUDA_REGISTER_HOST", "1", 1);
        if (fn) for (void * q : p.ptrs) fn(q);
        if (!had_env) unsetenv("GGML_CUDA_REGISTER_HOST");
    }
    p = pinned_t();
}

// Pins the routed-expert tensors of `model` (all of them: a residency switch changes which are cold).
// Ranges are page-aligned and merged within one buffer (gaps under 64 MiB are pinned too) to keep
// the calls few.
void pin_experts(llama_model * model, ggml_backend_dev_t dev) {
    if (g_pin.model == model) return;
    unpin(g_pin);
    g_pin.model = model;
    if (!dev || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) return;
    struct range_t { const void * buf; uintptr_t a, b; };
    std::vector<range_t> r;
    for (const auto & L : model->layers) {
        // the expert biases too: a copy that spans the end of a pinned range into pageable memory
        // fails (cudaMemcpyAsync: invalid argument), which aborted gpt-oss's upload path
        for (const ggml_tensor * t : {L.ffn_up_exps, L.ffn_gate_exps, L.ffn_down_exps, L.ffn_gate_up_exps,
                                      L.ffn_up_exps_b, L.ffn_gate_exps_b, L.ffn_down_exps_b, L.ffn_gate_up_exps_b}) {
            if (!t || !t->buffer || !ggml_backend_buffer_is_host(t->buffer) || !t->data) continue;
            if (std::strstr(ggml_backend_buffer_name(t->buffer), "CUDA_Host")) { g_pin.already_pinned = true; continue; }
            r.push_back({t->buffer, (uintptr_t) t->data, (uintptr_t) t->data + ggml_nbytes(t)});
        }
    }
    if (r.empty()) return;
    const uintptr_t page = 4096, gap = 64u << 20;
    std::sort(r.begin(), r.end(), [](const range_t & x, const range_t & y) {
        return x.buf != y.buf ? x.buf < y.buf : x.a < y.a;
    });
    std::vector<std::pair<uintptr_t, uintptr_t>> m;
    const void * last_buf = nullptr;
    for (auto [buf, a, b] : r) {
        a &= ~(page - 1); b = (b + page - 1) & ~(page - 1);
        if (!m.empty() && buf == last_buf && a <= m.back().second + gap) m.back().second = std::max(m.back().second, b);
        else m.push_back({a, b});
        last_buf = buf;
    }
    g_pin.reg = ggml_backend_dev_backend_reg(dev);
    auto fn = (bool (*)(void *, size_t)) ggml_backend_reg_get_proc_address(g_pin.reg, "ggml_backend_register_host_buffer");
    if (!fn) { g_pin.note = "the GPU backend cannot pin host memory: cold experts stay pageable"; return; }
    // ggml's CUDA backend registers only when GGML_CUDA_REGISTER_HOST is set
    const bool had_env = std::getenv("GGML_CUDA_REGISTER_HOST") != nullptr;
    if (!had_env) setenv("GGML_CUDA_REGISTER_HOST", "1", 1);
    const int64_t t0 = now_us();
    int64_t failed = 0;
    for (auto [a, b] : m) {
        if (fn((void *) a, b - a)) { g_pin.ptrs.push_back((void *) a); g_pin.bytes += (int64_t) (b - a); }
        else failed += (int64_t) (b - a);
    }
    if (!had_env) unsetenv("GGML_CUDA_REGISTER_HOST");
    if (failed) {
        g_pin.note = "pinning " + std::to_string(failed >> 20) + " MiB of cold experts failed (cudaHostRegister): "
                     "those stay pageable and upload slower";
        LLAMA_LOG_WARN("ostinato: %s\n", g_pin.note.c_str());
    }
    LLAMA_LOG_INFO("ostinato: pinned %.1f MiB of host experts in %zu ranges, %.1f ms\n", g_pin.bytes / 1048576.0,
                   g_pin.ptrs.size(), (now_us() - t0) / 1000.0);
}

}  // namespace ost
