"""GPT-OSS's expert MLP composed from lean's kernels (group_slots, gmm with the expert biases,
moe_glu_fwd, moe_combine) against transformers' GptOssExperts in fp32 (the CPU interpreter):
the layouts (gate_up_proj (E, C, 2F) passed transposed, gate / up interleaved, biases per expert)
and the clamped activation as HF computes them. The MXFP4 variant reads the packed blocks through
gmm_mxfp4 where HF dequantises them with its own convert_moe_packed_tensors."""
import pytest
import torch

from lean.kernels.grouped_gemm import gmm
from lean.kernels.moe_glu import moe_glu_fwd
from lean.kernels.moe_group import group_slots, moe_combine
from lean.kernels.mxfp4 import gmm_mxfp4
from tests.util import DEVICE, assert_close_rule, fresh_generator, randn

N, K, E, C, F = 13, 2, 4, 64, 32          # C, F multiples of 32: MXFP4 blocks


def _hf_experts():
    cfg_mod = pytest.importorskip("transformers.models.gpt_oss.configuration_gpt_oss")
    mod = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    cfg = cfg_mod.GptOssConfig(hidden_size=C, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K)
    return mod.GptOssExperts(cfg).to(DEVICE)


def _routing(g):
    experts = torch.stack([torch.randperm(E, generator=g, device=DEVICE)[:K] for _ in range(N)]).to(torch.int32)
    weights = torch.softmax(randn(N, K, g=g), dim=1)
    return experts, weights


def _lean_experts(x, experts, weights, gate_up, down, gate_up_bias, down_bias, limit, alpha):
    """out (N, C); gate_up / down: callables (y, x, offsets, **kw) running the two expert GEMMs."""
    P = N * K
    order, slot_pos = torch.empty(P, dtype=torch.int32, device=DEVICE), torch.empty(P, dtype=torch.int32, device=DEVICE)
    offsets = torch.empty(E + 1, dtype=torch.int32, device=DEVICE)
    group_slots(order, slot_pos, offsets, experts)
    h = torch.empty(P, 2 * F, device=DEVICE)                                     # (P, 2F) interleaved
    gate_up(h, x, offsets, gather=order, gather_div=K, bias=gate_up_bias)
    act = torch.empty(P, F, device=DEVICE)
    moe_glu_fwd(act, h, limit=limit, alpha=alpha)
    y = torch.empty(P, C, device=DEVICE)
    down(y, act, offsets, bias=down_bias)
    out = torch.empty(N, C, device=DEVICE)
    moe_combine(out, y, slot_pos, weights)
    return out


def test_layout_matches_hf():
    g = fresh_generator()
    hf = _hf_experts()
    with torch.no_grad():
        for p in (hf.gate_up_proj, hf.down_proj):
            p.copy_(randn(*p.shape, g=g, scale=0.3))
        for p in (hf.gate_up_proj_bias, hf.down_proj_bias):
            p.copy_(randn(*p.shape, g=g))
    x = randn(N, C, g=g, scale=2.0)                # big enough that some gates / ups pass +-limit
    experts, weights = _routing(g)
    with torch.no_grad():
        ref = hf(x, experts.long(), weights)
    out = _lean_experts(
        x, experts, weights,
        lambda y, a, off, **kw: gmm(y, a, hf.gate_up_proj.detach().transpose(1, 2), off, **kw),
        lambda y, a, off, **kw: gmm(y, a, hf.down_proj.detach().transpose(1, 2), off, **kw),
        hf.gate_up_proj_bias.detach(), hf.down_proj_bias.detach(), hf.limit, hf.alpha)
    assert_close_rule(out, ref.double(), name="experts out")


def test_mxfp4_matches_hf_dequantised():
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    g = fresh_generator()
    hf = _hf_experts()
    # checkpoint tensors: gate_up_proj_blocks (E, 2F, C/32, 16), down_proj_blocks (E, C, F/32, 16)
    blocks = {n: torch.randint(0, 256, (E, a, b // 32, 16), generator=g, device=DEVICE, dtype=torch.int32).to(torch.uint8)
              for n, a, b in (("gate_up", 2 * F, C), ("down", C, F))}
    scales = {n: torch.randint(123, 128, b.shape[:3], generator=g, device=DEVICE, dtype=torch.int32).to(torch.uint8)
              for n, b in blocks.items()}
    with torch.no_grad():
        hf.gate_up_proj.copy_(mx.convert_moe_packed_tensors(blocks["gate_up"], scales["gate_up"], dtype=torch.float32))
        hf.down_proj.copy_(mx.convert_moe_packed_tensors(blocks["down"], scales["down"], dtype=torch.float32))
        for p in (hf.gate_up_proj_bias, hf.down_proj_bias):
            p.copy_(randn(*p.shape, g=g))
    x = randn(N, C, g=g, scale=0.5)
    experts, weights = _routing(g)
    with torch.no_grad():
        ref = hf(x, experts.long(), weights)
    out = _lean_experts(
        x, experts, weights,
        lambda y, a, off, **kw: gmm_mxfp4(y, a, blocks["gate_up"], scales["gate_up"], off, **kw),
        lambda y, a, off, **kw: gmm_mxfp4(y, a, blocks["down"], scales["down"], off, **kw),
        hf.gate_up_proj_bias.detach(), hf.down_proj_bias.detach(), hf.limit, hf.alpha)
    assert_close_rule(out, ref.double(), name="experts out (MXFP4)")
