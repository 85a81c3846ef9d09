// The CPU branch's kernel: matching a CPU-branch graph to the one shape it computes (ost_ffn_match).
#include "cpu_branch/kernel.h"

#include "ggml-cpu.h"

#include <cstring>
#include <string>

namespace {

bool host_weights(const ggml_tensor * w) {
    // not a repacked CPU tensor (its extra holds the repack traits, its rows another layout)
    const ggml_tensor * s = w && w->view_src ? w->view_src : w;
    return w && (w->op == GGML_OP_NONE || w->op == GGML_OP_VIEW) && w->data && !s->extra && w->view_offs == 0 && ggml_n_dims(w) == 3 && w->nb[0] == ggml_type_size(w->type) &&
           ggml_get_type_traits_cpu(w->type)->vec_dot != nullptr;
}

bool is_mmid(const ggml_tensor * t, const ggml_tensor * x, const ggml_tensor * ids) {
    return t && t->op == GGML_OP_MUL_MAT_ID && t->type == GGML_TYPE_F32 && t->src[1] == x && t->src[2] == ids &&
           host_weights(t->src[0]);
}

}  // namespace

bool ost_ffn_match(const ggml_tensor * out, const ggml_tensor * ids, const ggml_tensor * cur, ost_ffn & f,
                   std::string & why) {
    f = ost_ffn{};
    if (!cur || cur->type != GGML_TYPE_F32 || !ggml_is_contiguous(cur) || cur->ne[1] != 1) {
        why = "input rows not F32 [n_embd, 1, n]";
        return false;
    }
    if (!ids || ids->type != GGML_TYPE_I32 || !ggml_is_contiguous(ids)) { why = "ids not contiguous I32"; return false; }
    if (!is_mmid(out, out ? out->src[1] : nullptr, ids)) { why = "output is not a mul_mat_id over host experts"; return false; }
    const ggml_tensor * act = out->src[1];
    const ggml_glu_op glu = act->op == GGML_OP_GLU ? ggml_get_glu_op(act) : GGML_GLU_OP_COUNT;
    if ((glu != GGML_GLU_OP_SWIGLU && glu != GGML_GLU_OP_SWIGLU_CLAMP) || !act->src[1] ||
        ((const int32_t *) act->op_params)[1] != 0 /* swapped */ || act->type != GGML_TYPE_F32 || !ggml_is_contiguous(act)) {
        why = "activation is not swiglu(gate, up) or swiglu_clamp(gate, up)";
        return false;
    }
    if (glu == GGML_GLU_OP_SWIGLU_CLAMP) {
        // the limit is the op's float parameter 3 (ggml_swiglu_clamp)
        memcpy(&f.swiglu_limit, (const char *) act->op_params + 3 * sizeof(int32_t), sizeof(float));
        if (!(f.swiglu_limit > 0.0f)) { why = "swiglu_clamp with a limit that is not positive"; return false; }
    }
    const ggml_tensor * g = act->src[0];
    const ggml_tensor * u = act->src[1];
    if (is_mmid(g, cur, ids) && is_mmid(u, cur, ids)) {
        f.gate = g->src[0];
        f.up = u->src[0];
        if (f.up->type != f.gate->type) { why = "up and gate of different types"; return false; }
    } else if (g->op == GGML_OP_VIEW && u->op == GGML_OP_VIEW && g->src[0] == u->src[0] && is_mmid(g->src[0], cur, ids)) {
        const ggml_tensor * gu = g->src[0];
        const int64_t n_ff = gu->ne[0] / 2;
        size_t og = 0, ou = 0;
        memcpy(&og, g->op_params, sizeof(og));
        memcpy(&ou, u->op_params, sizeof(ou));
        if (g->ne[0] != n_ff || u->ne[0] != n_ff || og != 0 || ou != (size_t) n_ff * sizeof(float) ||
            g->nb[1] != gu->nb[1] || u->nb[1] != gu->nb[1]) {
            why = "merged gate_up views not [gate | up]";
            return false;
        }
        f.up = gu->src[0];
        f.merged = true;
    } else {
        why = "gate and up are not mul_mat_ids of the input";
        return false;
    }
    f.down = out->src[0];
    f.n_embd = cur->ne[0];
    f.n_ff = f.merged ? f.up->ne[1] / 2 : f.up->ne[1];
    f.n_expert = f.down->ne[2];
    if (f.up->ne[0] != f.n_embd || f.down->ne[0] != f.n_ff || f.down->ne[1] != f.n_embd ||
        f.up->ne[2] != f.n_expert || (f.gate && (f.gate->ne[0] != f.n_embd || f.gate->ne[1] != f.n_ff ||
                                                 f.gate->ne[2] != f.n_expert))) {
        why = "expert tensor shapes do not agree";
        return false;
    }
    f.expert_bytes = (int64_t) (f.up->nb[1] * f.up->ne[1] + (f.gate ? f.gate->nb[1] * f.gate->ne[1] : 0) +
                                f.down->nb[1] * f.down->ne[1]);
    return true;
}
