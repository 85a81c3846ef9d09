"""What a synthetic model is: shapes, architectures, quant types, the tokenizer's added tokens and
the routing knobs (see :mod:`ostinatod.synth` for the method)."""

from __future__ import annotations

from dataclasses import dataclass


from gguf import GGMLQuantizationType as QT


SYNTH_FORMAT = "ostinato-synth/1"
VOCAB_NAME = "ggml-vocab-qwen2.gguf"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"

# Fine token classes (index into the class directions) and the coarse kind each belongs to.
SYNTAX, IDENT, WORD, NAME, NUMBER, MISC = range(6)
FINE_NAMES = ("syntax", "ident", "word", "name", "number", "misc")
CODE, PROSE, OTHER = 0, 1, 2
CLASS_NAMES = ("code", "prose", "other")
COARSE_OF = (CODE, CODE, PROSE, PROSE, OTHER, OTHER)


class SynthError(RuntimeError):
    """A synthetic model cannot be written (bad arguments, vocabulary not found)."""


@dataclass(frozen=True)
class Shape:
    """Dimensions of a synthetic model (names follow llama.cpp's hparams).

    ``n_ff_exp``: intermediate size of one routed expert; ``n_expert_shared``: shared experts
    (deepseek2); MLA sizes are used by deepseek2 only.
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


SHAPES: dict[str, Shape] = {
    # CI: ~10 MB of embedding/output plus well under 1 MB of layers.
    "tiny": Shape(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16,
                  n_expert=8, n_expert_used=2, n_ff_exp=64,
                  q_lora_rank=32, kv_lora_rank=32, qk_rope_dim=16, qk_nope_dim=16, v_head_dim=16),
    # demo model: generated in well under a minute, tens of tokens/s on 2 CPU cores.
    "small": Shape(n_layer=8, n_embd=256, n_head=8, n_head_kv=2, head_dim=32,
                   n_expert=32, n_expert_used=4, n_ff_exp=128,
                   q_lora_rank=64, kv_lora_rank=64, qk_rope_dim=16, qk_nope_dim=32, v_head_dim=32),
    # Qwen3-30B-A3B (config.json of the released model): use --layers to cut depth.
    "qwen3-30b-a3b": Shape(n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
                           n_expert=128, n_expert_used=8, n_ff_exp=768, n_ctx_train=262144,
                           q_lora_rank=768, kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128,
                           v_head_dim=128),
}

ARCHS = ("qwen3moe", "deepseek2", "gpt-oss")
QUANTS = {"f16": QT.F16, "q8_0": QT.Q8_0, "q4_0": QT.Q4_0, "mxfp4": QT.MXFP4}
# general.file_type (llama_ftype) of a file whose experts are in that quant
FTYPES = {"f16": 1, "q8_0": 7, "q4_0": 2, "mxfp4": 38}

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
    ``strength``: A, the weight of the preference in the router logit (None: by expert count);
    ``spread``: B, the per-token noise in the router logit;
    ``branch_scale``: attention/expert output size relative to the residual, for the whole depth.
    """

    class_energy: float = 0.5
    related_corr: float = 0.5
    strength: float | None = None
    spread: float = 1.0
    branch_scale: float = 0.5

    def strength_for(self, n_expert: int) -> float:
        # tuned by simulation on the class mix of ../shared/sessions/swe.jsonl so that the top 44 %
        # of experts take ~84 % of the routes (32 experts: A=1.6, 128 experts: A=0.9)
        if self.strength is not None:
            return self.strength
        return min(2.5, 0.9 * (128.0 / max(n_expert, 2)) ** 0.4)
