"""What a synthetic model is: shapes, architectures, quant types, the tokenizer's added tokens and
the routing knobs (see :mod:`ostinatod.synth` for the method)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from gguf import GGMLQuantizationType as QT

from ..errors import MessageError


SYNTH_FORMAT = "ostinato-synth/4"  # 2: the copy head (old branch files), 3: only on the real-model shapes,
# 4: the copy head picks its position by distance (copy_lag)
VOCAB_NAME = "ggml-vocab-qwen2.gguf"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

# Fine token classes (index into the class directions) and the coarse kind each belongs to.
SYNTAX, IDENT, WORD, NAME, NUMBER, MISC = range(6)
FINE_NAMES = ("syntax", "ident", "word", "name", "number", "misc")
CODE, PROSE, OTHER = 0, 1, 2
CLASS_NAMES = ("code", "prose", "other")
COARSE_OF = (CODE, CODE, PROSE, PROSE, OTHER, OTHER)


class SynthError(MessageError, RuntimeError):
    """A synthetic model cannot be written (bad arguments, vocabulary not found)."""

    code, status = "synth_failed", 500


@dataclass(frozen=True)
class Shape:
    """Dimensions of a synthetic model (names follow llama.cpp's hparams).

    ``n_ff_exp``: intermediate size of one routed expert; ``n_expert_shared``: shared experts
    (deepseek2, glm4moe, deepseek4; qwen35moe has one of ``n_ff_shexp``); MLA sizes are used by
    deepseek2 only (``q_lora_rank`` and ``qk_rope_dim`` by deepseek4 too); ``n_rot``: rotary dims
    (0: the arch's rule: glm4moe / minimax-m2 head_dim / 2, qwen35moe head_dim / 4, deepseek4
    qk_rope_dim, others head_dim); ``ssm_*``: qwen35moe's gated delta-net (linear attention) layers,
    every ``full_attn_interval``-th layer full attention; ``o_*``, ``hc_*``, ``hash_layers``,
    ``indexer_*``: deepseek4 (grouped low-rank output, hyper-connections, hash-routed leading
    layers, the compressed-attention indexer); the deepseek4 compress ratios follow the released
    schedule ``[0, 0, 4, 128, 4, 128, ...]`` unless ``compress_schedule`` lists them per layer (a
    representative cut, :mod:`ostinatod.synth.mix`).
    """

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ctx_train: int = 131072
    # deepseek2
    n_expert_shared: int = 1
    n_layer_dense_lead: int = 1
    n_ff_dense: int = 0          # 0: 4 * n_ff_exp
    q_lora_rank: int = 0         # 0: no q compression (plain attn_q)
    kv_lora_rank: int = 64
    qk_rope_dim: int = 16
    qk_nope_dim: int = 32
    v_head_dim: int = 32
    # glm4moe, minimax-m2, qwen35moe, deepseek4
    n_rot: int = 0
    n_ff_shexp: int = 0          # qwen35moe shared expert FFN (0: n_ff_exp)
    rope_sections: tuple[int, ...] = ()  # qwen35moe IMROPE sections (0: n_rot/2 split 3:3:2)
    ssm_d_state: int = 128
    ssm_n_group: int = 2
    ssm_dt_rank: int = 4
    ssm_d_conv: int = 4
    full_attn_interval: int = 4
    o_groups: int = 2
    o_lora_rank: int = 32
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hash_layers: int = 1
    indexer_n_head: int = 4
    indexer_head_dim: int = 64
    indexer_top_k: int = 512
    sliding_window: int = 128
    compress_schedule: tuple[int, ...] = ()  # deepseek4 per-layer ratios (): the released schedule


SHAPES: dict[str, Shape] = {
    # CI: ~10 MB of embedding/output plus well under 1 MB of layers.
    "tiny": Shape(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16,
                  n_expert=8, n_expert_used=2, n_ff_exp=64,
                  q_lora_rank=32, kv_lora_rank=32, qk_rope_dim=16, qk_nope_dim=16, v_head_dim=16,
                  ssm_d_state=16, ssm_n_group=2, ssm_dt_rank=4, full_attn_interval=2,
                  o_groups=2, o_lora_rank=16, indexer_head_dim=64),
    # CI for the quant recipes: rows of 256 values, so K-quant and IQ4_XS blocks fit (gate/up rows
    # are n_embd, down rows n_ff_exp); 4 layers: qwen35moe 3 linear + 1 full attention, deepseek4
    # compress ratios 0, 0, 4, 128 (both compressor kinds) and one hash-routed layer.
    "ci": Shape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                n_expert=8, n_expert_used=2, n_ff_exp=256, n_ff_dense=512,
                q_lora_rank=64, kv_lora_rank=64, qk_rope_dim=16, qk_nope_dim=32, v_head_dim=32,
                ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4, full_attn_interval=4,
                o_groups=2, o_lora_rank=32, indexer_n_head=4, indexer_head_dim=64),
    # demo model: generated in well under a minute, tens of tokens/s on 2 CPU cores.
    "small": Shape(n_layer=8, n_embd=256, n_head=8, n_head_kv=2, head_dim=32,
                   n_expert=32, n_expert_used=4, n_ff_exp=128,
                   q_lora_rank=64, kv_lora_rank=64, qk_rope_dim=16, qk_nope_dim=32, v_head_dim=32),
    # Qwen3-30B-A3B (config.json of the released model): use --layers to cut depth.
    "qwen3-30b-a3b": Shape(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                           n_expert=128, n_expert_used=8, n_ff_exp=768, n_ctx_train=262144,
                           q_lora_rank=768, kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128,
                           v_head_dim=128),
    # DeepSeek-V4-Flash (deepseek-ai/DeepSeek-V4-Flash config.json): 43 layers, all MoE, hidden
    # 4096, 64 heads x 512 (one KV head), qk_rope 64, q_lora 1024, o_groups 8, o_lora 1024,
    # 256 experts, k = 6, 1 shared expert, moe_intermediate 2048, hc_mult 4 (20 Sinkhorn
    # iterations), 3 hash-routed layers, indexer 64 heads x 128 (top-k 512), sliding window 128,
    # compress_ratios [0, 0] + [4, 128] * 20 + [4], 1M context. Experts MXFP4 (13.4 MB each,
    # as in the paper, docs/design.md).
    "deepseek-v4-flash": Shape(n_layer=43, n_embd=4096, n_head=64, n_head_kv=1, head_dim=512,
                               n_expert=256, n_expert_used=6, n_ff_exp=2048, n_ctx_train=1048576,
                               n_expert_shared=1, n_layer_dense_lead=0, q_lora_rank=1024,
                               qk_rope_dim=64, o_groups=8, o_lora_rank=1024, hc_mult=4,
                               hc_sinkhorn_iters=20, hash_layers=3, indexer_n_head=64,
                               indexer_head_dim=128, indexer_top_k=512, sliding_window=128),
    # Qwen3.5-35B-A3B and Qwen3.6-35B-A3B (same text config, Qwen/Qwen3.5-35B-A3B config.json
    # text_config): 40 layers (3 gated delta-net : 1 gated attention, full_attention_interval 4),
    # hidden 2048, 16 heads (2 KV) x 256, partial rotary 0.25 (64 dims, mrope sections
    # 11/11/10), 256 experts, k = 8, moe_intermediate 512, one shared expert of 512; linear
    # attention 16 key heads, 32 value heads, head dims 128, conv kernel 4; 262k context.
    "qwen3.5-35b-a3b": Shape(n_layer=40, n_embd=2048, n_head=16, n_head_kv=2, head_dim=256,
                             n_expert=256, n_expert_used=8, n_ff_exp=512, n_ctx_train=262144,
                             n_rot=64, n_ff_shexp=512, rope_sections=(11, 11, 10, 0),
                             ssm_d_state=128, ssm_n_group=16, ssm_dt_rank=32, ssm_d_conv=4,
                             full_attn_interval=4),
    # GLM-4.5-Air (zai-org/GLM-4.5-Air config.json): 46 layers, the first dense
    # (first_k_dense_replace 1, intermediate 10944), hidden 4096, 96 heads (8 KV) x 128, partial
    # rotary 0.5, q/k/v biases, 128 experts, k = 8, 1 shared expert, moe_intermediate 1408
    # (not a multiple of 256: the K-quant recipes fall back on ffn_down_exps, as llama.cpp does).
    "glm-4.5-air": Shape(n_layer=46, n_embd=4096, n_head=96, n_head_kv=8, head_dim=128,
                         n_expert=128, n_expert_used=8, n_ff_exp=1408, n_ctx_train=131072,
                         n_expert_shared=1, n_layer_dense_lead=1, n_ff_dense=10944, n_rot=64),
    # MiniMax-M2 (MiniMaxAI/MiniMax-M2 config.json): 62 layers, hidden 3072, 48 heads (8 KV) x 128,
    # rotary_dim 64, q/k norms over all heads, 256 experts, k = 8, intermediate 1536, no shared
    # expert, sigmoid scoring with routing bias; 196k context.
    "minimax-m2": Shape(n_layer=62, n_embd=3072, n_head=48, n_head_kv=8, head_dim=128,
                        n_expert=256, n_expert_used=8, n_ff_exp=1536, n_ctx_train=196608,
                        n_expert_shared=0, n_rot=64),
}

def narrow_shape(s: Shape) -> Shape:
    """A narrow version of a real model's shape for checks on a small machine: the same layers, layer
    kinds, expert count and k (what the routing depends on: the skew mechanism is the same), with
    the widths of the ``ci`` shape (hidden 256, heads of 64, experts of 64; rows of 256 so every
    quant recipe fits). Its per-layer sizes are not the real model's: for routing figures only."""
    return replace(s, n_embd=256, n_head=4, n_head_kv=min(s.n_head_kv, 2), head_dim=64, n_ff_exp=64,
                   n_ff_dense=256 if s.n_ff_dense or s.n_layer_dense_lead else 0,
                   n_ff_shexp=64 if s.n_ff_shexp else 0, q_lora_rank=64 if s.q_lora_rank else 0,
                   kv_lora_rank=64, qk_rope_dim=16, qk_nope_dim=32, v_head_dim=32, n_rot=0,
                   rope_sections=(), ssm_d_state=32, ssm_n_group=2, ssm_dt_rank=4, o_groups=2,
                   o_lora_rank=32, indexer_n_head=4, indexer_head_dim=64)


# shapes of one real model belong to its architecture
ARCH_SHAPES = {"qwen3-30b-a3b": "qwen3moe", "deepseek-v4-flash": "deepseek4",
               "qwen3.5-35b-a3b": "qwen35moe", "glm-4.5-air": "glm4moe", "minimax-m2": "minimax-m2"}
# archs whose llama.cpp loader takes ffn_gate_up_exps (create_tensor_gate_up_exps)
MERGED_GATE_UP_ARCHS = ("deepseek2", "qwen35moe")

ARCHS = ("qwen3moe", "deepseek2", "gpt-oss", "glm4moe", "minimax-m2", "qwen35moe", "deepseek4")
# quant recipe -> the main type of its routed experts (the mix is in .quants.tensor_type)
QUANTS = {"f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "mxfp4": QT.MXFP4, "q4_k_m": QT.Q4_K,
          "q5_k_m": QT.Q5_K, "q6_k": QT.Q6_K, "iq4_xs": QT.IQ4_XS, "ud-q4_k_xl": QT.Q4_K}

# Qwen3's added tokens sit at these ids in its 151,936-entry vocabulary; the qwen2 test vocabulary
# of llama.cpp has [PADnnn] placeholders there, which we name so the chat markers are single tokens.
ADDED_TOKENS: dict[int, tuple[str, int]] = {
    151646: ("<|object_ref_start|>", 3), 151647: ("<|object_ref_end|>", 3),
    151648: ("<|box_start|>", 3), 151649: ("<|box_end|>", 3),
    151650: ("<|quad_start|>", 3), 151651: ("<|quad_end|>", 3),
    151652: ("<|vision_start|>", 3), 151653: ("<|vision_end|>", 3),
    151654: ("<|vision_pad|>", 3), 151655: ("<|image_pad|>", 3), 151656: ("<|video_pad|>", 3),
    151657: ("<tool_call>", 4), 151658: ("</tool_call>", 4),
    151659: ("<|fim_prefix|>", 3), 151660: ("<|fim_middle|>", 3), 151661: ("<|fim_suffix|>", 3),
    151662: ("<|fim_pad|>", 3), 151663: ("<|repo_name|>", 3), 151664: ("<|file_sep|>", 3),
    151665: ("<tool_response>", 4), 151666: ("</tool_response>", 4),
    151667: ("<think>", 4), 151668: ("</think>", 4),
}
TOKEN_ENDOFTEXT, TOKEN_IM_START, TOKEN_IM_END = 151643, 151644, 151645


@dataclass(frozen=True)
class Routing:
    """Knobs of the synthetic routing (see the module docstring for the formula).

    ``class_energy``: rho, share of an embedding's energy along its class direction;
    ``related_corr``: correlation of the per-layer expert rankings of related fine classes
    (syntax~ident, word~name, number~misc); unrelated classes rank independently;
    ``strength``: A, the weight of the preference in the router logit (None: from ``skew``);
    ``skew``: the held-out share of the dev top-44% experts the routers are made for (A from
    :func:`ostinatod.synth.skew.strength_for_skew`; None: made for 0.84 where calibrated,
    :func:`ostinatod.synth.skew.router_strength`);
    ``spread``: B, the per-token noise in the router logit;
    ``branch_scale``: attention/expert output size relative to the residual, for the whole depth;
    ``copy_dims``: width of the copy subspace (at most a quarter of the hidden size), ``copy_gain``:
    size of the copy relative to the embedding, ``copy_sharpness``: by how much the copy head's
    score at the distance ``copy_lag`` (tokens back: the position it copies) beats its score at
    any other distance (see :mod:`ostinatod.synth.copy_head`): what makes a decode
    step route like a prompt token; ``copy_head``: whether the file has one (None: by shape,
    :func:`copy_head_by_default`).
    """

    class_energy: float = 0.5
    related_corr: float = 0.5
    strength: float | None = None
    skew: float | None = None
    spread: float = 1.0
    branch_scale: float = 0.5
    copy_dims: int = 256
    copy_gain: float = 1.0
    copy_sharpness: float = 12.0
    copy_lag: int = 96
    copy_head: bool | None = None


def copy_head_by_default(shape: str) -> bool:
    """Whether a file of ``shape`` (a key of :data:`SHAPES`) gets the copy head when
    ``Routing.copy_head`` is None: the real-model shapes (the bench's files) do; the test and demo
    shapes (tiny, ci, small) do not. A copy head makes a greedy token a copy of a context token,
    so under a grammar it fills the free parts (whitespace, a reasoning block the grammar lets
    open) with copies of the context; a ``<think>`` block opened that way never closes (the
    closing tag is not in the context) and the answer runs to its token cap. The API tests and
    the demo depend on grammar-constrained greedy answers that end, which a random model without
    the copy head gives (docs/synthetic-models.md, "The copy head")."""
    return shape in ARCH_SHAPES
