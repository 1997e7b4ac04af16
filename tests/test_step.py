"""The whole LoRA step against HF transformers + PEFT, on tiny random configs (CPU, float32)."""
import dataclasses
import numpy as np
import pytest
import torch

import lean
from lean.reference.hf_peft import hf_loss_and_grads, peft_wrap
from tests.hf_models import build_hf
from tests.util import DEVICE, fresh_generator


def _random_docs(rng, vocab, lens, masked=False):
    docs = []
    for n in lens:
        ids = rng.integers(0, vocab, n).tolist()
        if masked:
            mask = (rng.random(n) < 0.7).tolist()
            mask[-1] = True
            docs.append((ids, mask))
        else:
            docs.append(ids)
    return docs


def _lean_setup(tmp_path, arch, seed, dtype=torch.float32, r=8, alpha=16, targets="all"):
    hf = build_hf(arch, seed)
    hf.save_pretrained(tmp_path / "model")
    model = lean.load_model(tmp_path / "model", dtype=dtype, device=DEVICE)
    lora = lean.LoRA.init(model, r=r, alpha=alpha, targets=targets, seed=seed)
    # B starts at zero in PEFT's init: make it non-zero so dA is non-trivial.
    g = torch.Generator().manual_seed(seed + 1)
    for layer in lora.layers:
        for ad in layer.values():
            ad.b.copy_(torch.randn(ad.b.shape, generator=g) * 0.05)
    lora.sync_lowp()
    return hf, model, lora


def _rel_max(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_step_matches_hf_peft(tmp_path, arch):
    gen = fresh_generator("cpu")
    seed = int(torch.randint(0, 2**30, (1,), generator=gen))
    rng = np.random.default_rng(seed)
    hf, model, lora = _lean_setup(tmp_path, arch, seed)
    lens = [int(x) for x in rng.integers(1, 24, 4)] + [1, 17]
    docs = _random_docs(rng, model.config.vocab, lens, masked=(arch == "qwen2"))
    batch = lean.pack(docs, max_tokens=128, device=DEVICE)

    lora.zero_grad()
    loss_sum, n = lean.forward_backward(model, lora, batch)
    ref_sum, ref_n, ref_grads = hf_loss_and_grads(peft_wrap(hf, lora), docs)
    assert n == ref_n
    assert abs(loss_sum.item() - ref_sum.item()) <= 1e-5 * abs(ref_sum.item())
    grads = lora.grad_state_dict()
    assert set(grads) == set(ref_grads)
    for k, ref in ref_grads.items():
        assert ref.abs().max() > 0, f"{k}: reference gradient is zero, test would be vacuous"
        err = _rel_max(grads[k], ref)
        assert err <= 1e-4, f"{k}: relative error {err:.2e}"


def test_packed_equals_one_at_a_time(tmp_path):
    gen = fresh_generator("cpu")
    seed = int(torch.randint(0, 2**30, (1,), generator=gen))
    rng = np.random.default_rng(seed)
    _, model, lora = _lean_setup(tmp_path, "qwen3", seed)
    docs = _random_docs(rng, model.config.vocab, [9, 1, 30, 4])
    n_total = sum(len(d) - 1 for d in docs)
    lora.zero_grad()
    packed_sum, _ = lean.forward_backward(model, lora, lean.pack(docs, max_tokens=64, device=DEVICE),
                                          grad_scale=1.0 / n_total)
    packed = lora.grads.clone()
    lora.zero_grad()
    single = 0.0
    for d in docs:
        s, _ = lean.forward_backward(model, lora, lean.pack([d], max_tokens=64, device=DEVICE),
                                     grad_scale=1.0 / n_total)
        single += s.item()
    assert abs(packed_sum.item() - single) <= 1e-5 * abs(single)
    assert _rel_max(packed, lora.grads) <= 1e-5


def test_forward_logits_match_hf(tmp_path):
    gen = fresh_generator("cpu")
    seed = int(torch.randint(0, 2**30, (1,), generator=gen))
    rng = np.random.default_rng(seed)
    hf, model, lora = _lean_setup(tmp_path, "llama", seed)
    docs = _random_docs(rng, model.config.vocab, [13, 5])
    logits = lean.forward(model, lora, lean.pack(docs, max_tokens=32, device=DEVICE))
    pm = peft_wrap(hf, lora)
    with torch.no_grad():
        ref = torch.cat([pm(input_ids=torch.tensor([d])).logits[0] for d in docs])
    assert _rel_max(logits, ref) <= 1e-5


def test_activation_plan_table_matches_what_layers_save(tmp_path):
    """The plan table names exactly the fields a layer saves, and its byte count is what they take."""
    from lean.models.dense import Saved
    from lean.runtime.plan import PLAN, layer_bytes
    from lean.runtime.step import Tape, _forward_layers, make_ctx

    assert [r.name for r in PLAN] == list(Saved._fields)
    for arch in ("llama", "qwen3"):
        _, model, lora = _lean_setup(tmp_path / arch, arch, 0, targets="q,v,down")
        batch = lean.pack([[1, 2, 3, 4, 5], [6, 7]], max_tokens=8, device=DEVICE)
        tape = Tape()
        _forward_layers(model, lora, batch, make_ctx(model, lora, batch), tape)
        saved = tape.records[0][1]
        seen = {}
        for name, t in saved._asdict().items():
            for u in (t.values() if isinstance(t, dict) else [t]):
                if u is not None:
                    seen[u.data_ptr()] = u.numel() * u.element_size()
        assert sum(seen.values()) == layer_bytes(model.config, 7, 4, lora.r, len(lora.targets))


def test_activation_plan_table_matches_what_moe_layers_save(tmp_path):
    """An MoE model's layers (Qwen3-MoE, one dense MLP layer): the MoE table names exactly the
    fields the MoE block saves, and each layer's byte count, priced as its kind with its own LoRA
    targets (expert adapters on MoE layers, no MLP adapter on the dense one), is what it holds."""
    from lean.models.moe import MoeSaved
    from lean.runtime.plan import MOE_PLAN, layer_bytes
    from lean.runtime.step import Tape, _forward_layers, make_ctx
    from tests.test_moe import _setup, moe_config

    assert [r.name for r in MOE_PLAN] == list(MoeSaved._fields)
    for targets in ("q,v,down", "gate,o"):
        _, model, lora = _setup(tmp_path / targets, moe_config(4, 2, True, [1], layers=3), 0, targets=targets)
        batch = lean.pack([[1, 2, 3, 4, 5], [6, 7]], max_tokens=8, device=DEVICE)
        tape = Tape()
        _forward_layers(model, lora, batch, make_ctx(model, lora, batch), tape)
        for li, (_, saved, _) in enumerate(tape.records):
            assert (saved.moe is not None) == model.config.is_moe(li)
            seen = {}

            def visit(t):
                if isinstance(t, torch.Tensor):
                    seen[t.data_ptr()] = t.numel() * t.element_size()
                elif isinstance(t, (dict, tuple)):
                    for u in (t.values() if isinstance(t, dict) else t):
                        visit(u)
            visit(saved)
            assert sum(seen.values()) == layer_bytes(model.config, 7, 4, lora.r, lora.targets, layer=li), (targets, li)


def test_a_batch_or_model_on_the_wrong_device_is_refused_by_name(monkeypatch):
    """A batch on another device than the model, and a CPU model where Triton's interpreter is off (a
    GPU machine), are refused with the cause and the fix, not Triton's "cpu tensor?" (which names
    neither), by every entry point that computes."""
    import lean.runtime.step as step_module
    from lean.models.config import config_from_hf
    from lean.models.weights import empty_model
    from lean.runtime.generate import generate
    from tests.hf_models import tiny_config

    cfg = config_from_hf(tiny_config("llama").to_dict())
    model = empty_model(cfg, torch.float32, DEVICE)
    batch = lean.pack([[1, 2, 3, 4]], max_tokens=8, device=DEVICE)
    elsewhere = dataclasses.replace(batch, **{f: getattr(batch, f).to("meta") for f in ("ids", "positions", "targets",
                                                                                          "cu_seqlens")})
    for call in (lambda: lean.forward_backward(model, None, elsewhere), lambda: lean.loss_eval(model, None, elsewhere),
                 lambda: lean.forward(model, None, elsewhere)):
        with pytest.raises(ValueError, match=r"the batch is on meta, the model on .*lean.pack\(..., device=model.device\)"):
            call()
    cpu_model = empty_model(cfg, torch.float32, "cpu")
    batch = lean.pack([[1, 2, 3, 4]], max_tokens=8, device="cpu")
    monkeypatch.setattr(step_module, "interpreting", lambda: False)   # as on a GPU machine
    for call in (lambda: lean.forward_backward(cpu_model, None, batch), lambda: lean.loss_eval(cpu_model, None, batch),
                 lambda: lean.forward(cpu_model, None, batch), lambda: generate(cpu_model, None, [1, 2], max_new_tokens=2)):
        with pytest.raises(ValueError, match="model is on the CPU.*TRITON_INTERPRET=1"):
            call()


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's limit: a CPU test")
def test_a_bfloat16_model_on_the_cpu_is_refused_not_wrong():
    """The interpreter multiplies bf16 bit patterns in tl.dot: a bf16 model on the CPU gave a loss of
    ~3e11 (float32: 178) without an error. Every entry point that computes refuses it, naming the fix."""
    from lean.models.config import config_from_hf
    from lean.models.weights import empty_model
    from lean.runtime.generate import generate
    from tests.hf_models import tiny_config

    model = empty_model(config_from_hf(tiny_config("llama").to_dict()), torch.bfloat16, "cpu")
    batch = lean.pack([[1, 2, 3, 4]], max_tokens=8)
    calls = (lambda: lean.forward_backward(model, None, batch), lambda: lean.loss_eval(model, None, batch),
             lambda: lean.forward(model, None, batch), lambda: generate(model, None, [1, 2], max_new_tokens=2))
    for call in calls:
        with pytest.raises(ValueError, match="bfloat16 model on the CPU.*dtype=torch.float32"):
            call()
