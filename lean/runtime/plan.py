"""The activation plan: every tensor a layer's forward saves for its backward, in one table.

Shape legend: N tokens, C hidden, H/KVH heads, D head dim, F MLP hidden, R LoRA rank.
act = the model's compute dtype. Policy today is `keep` for every row (saved on the GPU); the
offload/recompute planner reads this same table, and so do the memory estimate and its test.

| name   | shape        | dtype | policy | what it is                                     |
|--------|--------------|-------|--------|------------------------------------------------|
| x      | (N, C)       | act   | keep   | layer input (residual stream)                  |
| rstd1  | (N,)         | fp32  | keep   | 1/rms of x                                     |
| n1     | (N, C)       | act   | keep   | rmsnorm(x) * w_in: input of q, k, v            |
| xa     | (N, R) each  | act   | keep   | drop(input) A^T of every LoRA projection       |
| q_pre  | (N, H*D)     | act   | keep   | q before QK-norm (Qwen3 only)                  |
| k_pre  | (N, KVH*D)   | act   | keep   | k before QK-norm (Qwen3 only)                  |
| rstd_q | (N*H,)       | fp32  | keep   | QK-norm statistics (Qwen3 only)                |
| rstd_k | (N*KVH,)     | fp32  | keep   | QK-norm statistics (Qwen3 only)                |
| q      | (N, H*D)     | act   | keep   | q after norm and RoPE                          |
| k      | (N, KVH*D)   | act   | keep   | k after norm and RoPE                          |
| v      | (N, KVH*D)   | act   | keep   | v                                              |
| o      | (N, H*D)     | act   | keep   | attention output: input of o_proj              |
| lse    | (H, N)       | fp32  | keep   | attention log-sum-exp                          |
| mid    | (N, C)       | act   | keep   | x + attention block output                     |
| rstd2  | (N,)         | fp32  | keep   | 1/rms of mid                                   |
| n2     | (N, C)       | act   | keep   | rmsnorm(mid) * w_post: input of gate, up       |
| gate   | (N, F)       | act   | keep   | gate projection (overwritten by its gradient)  |
| up     | (N, F)       | act   | keep   | up projection (overwritten by its gradient)    |
| act    | (N, F)       | act   | keep   | silu(gate) * up: input of down                 |
"""
from typing import NamedTuple


class Row(NamedTuple):
    name: str
    shape: str  # in the legend's symbols; "R*" = one (N, R) per LoRA projection
    dtype: str  # "act" or "fp32"
    policy: str  # "keep" | "offload" | "recompute"
    when: str = "always"  # "always" | "qk_norm" | "lora"


PLAN = (
    Row("x", "N,C", "act", "keep"),
    Row("rstd1", "N", "fp32", "keep"),
    Row("n1", "N,C", "act", "keep"),
    Row("xa", "N,R*", "act", "keep", "lora"),
    Row("q_pre", "N,H*D", "act", "keep", "qk_norm"),
    Row("k_pre", "N,KVH*D", "act", "keep", "qk_norm"),
    Row("rstd_q", "N*H", "fp32", "keep", "qk_norm"),
    Row("rstd_k", "N*KVH", "fp32", "keep", "qk_norm"),
    Row("q", "N,H*D", "act", "keep"),
    Row("k", "N,KVH*D", "act", "keep"),
    Row("v", "N,KVH*D", "act", "keep"),
    Row("o", "N,H*D", "act", "keep"),
    Row("lse", "H,N", "fp32", "keep"),
    Row("mid", "N,C", "act", "keep"),
    Row("rstd2", "N", "fp32", "keep"),
    Row("n2", "N,C", "act", "keep"),
    Row("gate", "N,F", "act", "keep"),
    Row("up", "N,F", "act", "keep"),
    Row("act", "N,F", "act", "keep"),
)


def row_bytes(row, cfg, n_tokens, act_bytes, lora_rank=0, n_lora_targets=0):
    """Bytes one layer spends on one row of the plan."""
    if row.when == "qk_norm" and not cfg.qk_norm:
        return 0
    if row.when == "lora" and not n_lora_targets:
        return 0
    sym = {"N": n_tokens, "C": cfg.hidden, "H": cfg.n_heads, "KVH": cfg.n_kv_heads, "D": cfg.head_dim,
           "F": cfg.intermediate, "R*": lora_rank * n_lora_targets}
    numel = 1
    for dim in row.shape.split(","):
        size = 1
        for factor in dim.split("*") if dim != "R*" else ["R*"]:
            size *= sym[factor]
        numel *= size
    return numel * (4 if row.dtype == "fp32" else act_bytes)


def layer_bytes(cfg, n_tokens, act_bytes, lora_rank=0, n_lora_targets=0):
    """What one layer's saved activations take on the GPU under the plan."""
    return sum(row_bytes(r, cfg, n_tokens, act_bytes, lora_rank, n_lora_targets)
               for r in PLAN if r.policy == "keep")
