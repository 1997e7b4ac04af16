"""Qwen3-MoE end to end against HF transformers + PEFT (CPU, float32): the step's loss and every
LoRA gradient (attention and experts), both checkpoint layouts, adapters both ways, the merge,
the load-balancing loss, and the routing-weight gradient's necessity."""
import json

import numpy as np
import pytest
import torch

import lean
from lean.reference.hf_peft import hf_loss_and_grads, peft_wrap
from tests.hf_models import build_hf
from tests.util import DEVICE, fresh_seed

# (E, K, norm_topk_prob, mlp_only_layers): k = 1 and k = E, some layers dense, renormalise both ways
CASES = {  # k = 1: test_few_tokens_leave_experts_empty (E 12)
    "e8k2-dense1": (8, 2, True, [1]),
    "e12k4": (12, 4, True, []),
    "e4k4": (4, 4, False, [0]),
}


def moe_config(E, K, norm, dense, layers=2, **kw):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{
        **dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=40, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=1, head_dim=32, vocab_size=131, max_position_embeddings=256,
               rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=E, num_experts_per_tok=K,
               norm_topk_prob=norm, mlp_only_layers=dense, dtype=torch.float32), **kw})


def _setup(tmp_path, config, seed, r=4, alpha=8, targets="all"):
    hf = build_hf("qwen3_moe", seed, config=config)
    with torch.no_grad():  # HF inits the router at zero: draw it, so that routing is not a tie
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path / "model")
    model = lean.load_model(tmp_path / "model", dtype=torch.float32, device=DEVICE)
    lora = lean.LoRA.init(model, r=r, alpha=alpha, targets=targets, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)  # B != 0, so that every dA is non-trivial
    for layer in lora.layers:
        for ad in layer.values():
            ad.b.copy_(torch.randn(ad.b.shape, generator=g) * 0.05)
    lora.sync_lowp()
    return hf, model, lora


def _docs(rng, vocab, lens):
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def _rel_max(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _compare(lora, loss_sum, n, ref_sum, ref_n, ref_grads, tol=1e-4):
    assert n == ref_n
    assert abs(loss_sum.item() - ref_sum.item()) <= 1e-5 * abs(ref_sum.item())
    grads = lora.grad_state_dict()
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    errs = {}
    for k, ref in ref_grads.items():
        assert ref.abs().max() > 0, f"{k}: reference gradient is zero, the test would be vacuous"
        errs[k] = _rel_max(grads[k], ref)
    bad = {k: e for k, e in errs.items() if e > tol}
    return bad


@pytest.mark.parametrize("case", list(CASES))
def test_moe_step_matches_hf_peft(tmp_path, case):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    hf, model, lora = _setup(tmp_path, moe_config(*CASES[case]), seed)
    assert any(w.moe for w in model.layers)
    docs = _docs(rng, model.config.vocab, [int(x) for x in rng.integers(2, 20, 3)] + [1, 9])
    batch = lean.pack(docs, max_tokens=96, device=DEVICE)
    lora.zero_grad()
    loss_sum, n = lean.forward_backward(model, lora, batch)
    ref = hf_loss_and_grads(peft_wrap(hf, lora), docs)
    assert any("experts" in k for k in ref[2]), "no expert adapter: the test would not cover the experts"
    bad = _compare(lora, loss_sum, n, *ref)
    assert not bad, f"seed {seed}: {bad}"


def test_few_tokens_leave_experts_empty(tmp_path):
    """Three tokens over twelve experts (k = 1): most experts get no token in any layer."""
    seed = fresh_seed()
    hf, model, lora = _setup(tmp_path, moe_config(12, 1, False, []), seed)
    docs = [[5, 77, 9]]
    lora.zero_grad()
    loss_sum, n = lean.forward_backward(model, lora, lean.pack(docs, max_tokens=8, device=DEVICE))
    counts = model.cache["moe"].counts
    assert int((counts == 0).sum()) >= 12 - 3 * len(model.config.moe_layers)
    bad = _compare(lora, loss_sum, n, *hf_loss_and_grads(peft_wrap(hf, lora), docs))
    assert not bad, f"seed {seed}: {bad}"


def test_routing_weight_gradient_is_needed(tmp_path, monkeypatch):
    """Dropping dL/d(routing weights) (the router's backward) must break the gradients below."""
    import lean.models.moe as moe

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    hf, model, lora = _setup(tmp_path, moe_config(8, 2, True, []), seed)
    docs = _docs(rng, model.config.vocab, [12, 7])
    real = moe.route_topk_bwd

    def dropped(dlogits, dweights, *a, **kw):
        dweights.zero_()
        real(dlogits, dweights, *a, **kw)

    monkeypatch.setattr(moe, "route_topk_bwd", dropped)
    lora.zero_grad()
    loss_sum, n = lean.forward_backward(model, lora, lean.pack(docs, max_tokens=32, device=DEVICE))
    bad = _compare(lora, loss_sum, n, *hf_loss_and_grads(peft_wrap(hf, lora), docs))
    assert bad, "the gradients matched HF without the routing-weight gradient: the check is vacuous"
    assert any("self_attn" in k for k in bad), "the attention gradients below a router should depend on it"


def test_aux_loss_matches_hf(tmp_path):
    """output_router_logits: the loss is the mean token loss + coef * HF's load_balancing_loss_func,
    and its gradient reaches every LoRA tensor below a router."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    cfg = moe_config(8, 2, True, [], output_router_logits=True, router_aux_loss_coef=0.5)
    hf, model, lora = _setup(tmp_path, cfg, seed)
    doc = _docs(rng, model.config.vocab, [23])[0]
    lora.zero_grad()
    loss_sum, n = lean.forward_backward(model, lora, lean.pack([doc], max_tokens=32, device=DEVICE))
    pm = peft_wrap(hf, lora)
    out = pm(input_ids=torch.tensor([doc]), labels=torch.tensor([doc]), output_router_logits=True)
    assert out.aux_loss.item() > 0
    out.loss.backward()
    ref = {k.replace(".default", ""): p.grad for k, p in pm.named_parameters() if "lora_" in k}
    assert abs(loss_sum.item() / n - out.loss.item()) <= 1e-5 * out.loss.item()
    assert abs(model.cache["moe"].aux.item() - out.aux_loss.item()) <= 1e-5 * out.aux_loss.item()
    grads = lora.grad_state_dict()
    for k, r in ref.items():
        assert _rel_max(grads[k], r) <= 1e-4, k


def test_hub_per_expert_layout_loads(tmp_path):
    """The hub's per-expert tensors load into the same fused views as transformers 5's layout."""
    from safetensors.torch import load_file, save_file

    seed = fresh_seed()
    hf, model, _ = _setup(tmp_path, moe_config(4, 2, True, [1]), seed)
    sd = load_file(str(tmp_path / "model" / "model.safetensors"))
    hub = {}
    for k, t in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            F = t.shape[1] // 2
            for e in range(t.shape[0]):
                hub[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :F].clone()
                hub[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, F:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                hub[k.replace("down_proj", f"{e}.down_proj.weight")] = t[e].clone()
        else:
            hub[k] = t
    d = tmp_path / "hub"
    d.mkdir()
    (d / "config.json").write_text((tmp_path / "model" / "config.json").read_text())
    names = sorted(hub)  # two shards, a layer's experts split between them
    save_file({k: hub[k] for k in names[: len(names) // 2]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: hub[k] for k in names[len(names) // 2:]}, str(d / "model-00002-of-00002.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f"model-0000{1 + (i >= len(names) // 2)}-of-00002.safetensors" for i, k in enumerate(names)}}))
    hub_model = lean.load_model(d, dtype=torch.float32, device=DEVICE)
    for (ka, a), (kb, b) in zip(model.hf_tensors(), hub_model.hf_tensors()):
        assert ka == kb and torch.equal(a, b), ka
    del hub[next(k for k in hub if ".experts.3.up_proj" in k)]
    save_file(hub, str(d / "model-00001-of-00002.safetensors"))
    (d / "model-00002-of-00002.safetensors").unlink()
    (d / "model.safetensors.index.json").unlink()
    with pytest.raises(lean.ModelLoadError, match="gate_up_proj"):
        lean.load_model(d, dtype=torch.float32, device=DEVICE)


def test_adapters_load_both_ways_and_merge(tmp_path):
    """lean's adapter loads in PEFT with equal logits; PEFT's loads in lean with equal tensors; the
    merge loads in transformers with the PEFT model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    hf, model, lora = _setup(tmp_path, moe_config(4, 2, True, [1]), seed)
    docs = _docs(rng, model.config.vocab, [11, 6])
    logits = lean.forward(model, lora, lean.pack(docs, max_tokens=32, device=DEVICE))
    lora.save(tmp_path / "ad")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    pm = PeftModel.from_pretrained(base, tmp_path / "ad")
    with torch.no_grad():
        ref = torch.cat([pm(input_ids=torch.tensor([d])).logits[0] for d in docs])
    assert _rel_max(logits, ref) <= 1e-5
    pm.save_pretrained(tmp_path / "ad_peft")  # PEFT's own file, read back by lean
    back = lean.LoRA.load(model, tmp_path / "ad_peft")
    for k, v in lora.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    from lean.runtime.merge import merge_and_save

    out = merge_and_save(model, lora, tmp_path / "merged", dtype="float32")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        mref = torch.cat([merged(input_ids=torch.tensor([d])).logits[0] for d in docs])
    assert _rel_max(mref, ref) <= 1e-5


def test_moe_step_dispatches_no_torch_compute_op():
    from tests.test_step_gpu import CONTAINER_OPS, OpRecorder

    hf = build_hf("qwen3_moe", 0, config=moe_config(4, 2, True, [1], layers=2))
    cfg = hf.config.to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]}
    model = lean.model_from_tensors(cfg, hf.state_dict(), dtype=torch.float32, device=DEVICE)
    lora = lean.LoRA.init(model, r=2, alpha=4, seed=0)
    opt = lean.AdamW(lora, lr=1e-3)
    batch = lean.pack([[1, 2, 3, 4, 5], [6, 7, 8]], max_tokens=16, device=DEVICE)
    with OpRecorder() as rec:
        lora.zero_grad()
        lean.forward_backward(model, lora, batch)
        opt.step()
    compute = sorted(set(rec.ops) - CONTAINER_OPS)
    assert rec.ops and not compute, f"torch did compute inside the MoE step: {compute}"


def test_moe_layer_rebuilt_in_backward_gives_the_same_bits(tmp_path):
    """A plan that recomputes the MoE layers (routing, grouping and expert rows rebuilt from the layer
    input in backward) gives the keep step's loss and gradients bit for bit."""
    from lean.runtime.plan import KEEP, RECOMPUTE, make_plan

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    _, model, lora = _setup(tmp_path, moe_config(8, 2, True, [1]), seed)
    batch = lean.pack(_docs(rng, model.config.vocab, [14, 5, 9]), max_tokens=32, device=DEVICE)
    lora.zero_grad()
    loss_keep, _ = lean.forward_backward(model, lora, batch, seed=3)
    grads_keep = lora.grads.clone()
    counts_keep = model.cache["moe"].counts.clone()
    plan = make_plan(model.config, batch.n_tokens, (RECOMPUTE, KEEP), lora_rank=lora.r)
    lora.zero_grad()
    loss_plan, _ = lean.forward_backward(model, lora, batch, seed=3, plan=plan)
    assert torch.equal(loss_plan, loss_keep)
    assert torch.equal(lora.grads, grads_keep)
    assert torch.equal(model.cache["moe"].counts, counts_keep), "the rebuild counted the slots again"


def test_train_runs_an_moe_model(tmp_path):
    """lean-train's loop on a Qwen3-MoE folder: the held-out loss falls, the metrics carry the expert
    load, the samples run the MoE block through generate's cache, and the adapter loads in PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import lean.runtime.train as T
    from tests.test_train import _records, _write_tokenizer

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    hf = build_hf("qwen3_moe", seed, config=moe_config(4, 2, True, [], layers=2, vocab_size=16))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path / "model")
    _write_tokenizer(tmp_path / "model")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records(rng)))
    cfg = T.TrainConfig(model=str(tmp_path / "model"), data=str(data), out_dir=str(tmp_path / "run"), max_tokens=40,
                        steps=3, lr=5e-2, warmup_steps=1, r=2, alpha=4, seed=seed % 1000, eval_every=0,
                        save_every=0, heldout_fraction=0.2, progress=False, sample_tokens=2, sample_prompt="the cat")
    out = T.train(cfg)
    assert out["eval_loss"] < out["eval_loss_before"]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if m["kind"] == "train"]
    assert len(train) == 3 and all(m["expert_load_max_over_mean"] >= 1.0 for m in train)
    assert sum(m["kind"] == "sample" for m in lines) == 2
    pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), tmp_path / "run" / "adapter")
    assert any("experts" in k for k, _ in pm.named_parameters())
