"""Loading, the batch descriptor and adapters: behaviour and the errors users meet."""
import json

import numpy as np
import pytest
import torch

import lean
from lean.models.config import config_from_hf
from tests.hf_models import build_hf, tiny_config
from tests.util import DEVICE


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    build_hf("qwen3", 0).save_pretrained(d)
    return d


# ---- config ----------------------------------------------------------------------------------

def test_config_dialects_4x_and_5x():
    cfg5 = tiny_config("llama").to_dict()
    c5 = config_from_hf(cfg5)
    assert c5.rope_scaling["rope_type"] == "llama3" and c5.rope_theta == 500000.0
    cfg4 = dict(cfg5)
    rp = cfg4.pop("rope_parameters")
    cfg4["rope_theta"] = rp.pop("rope_theta")
    cfg4["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in rp.items()}
    cfg4.pop("tie_word_embeddings")  # 4.x omits the key when it is True
    c4 = config_from_hf(cfg4)
    assert c4.rope_scaling == c5.rope_scaling and c4.rope_theta == c5.rope_theta
    assert c4.tie_embeddings is True


def test_qwen3_config_fields():
    c = config_from_hf(tiny_config("qwen3").to_dict())
    assert c.qk_norm and c.tie_embeddings and c.head_dim == 32 and c.head_dim * c.n_heads != c.hidden
    c2 = config_from_hf(tiny_config("qwen2").to_dict())
    assert c2.qkv_bias and not c2.o_bias and not c2.qk_norm


@pytest.mark.parametrize("patch, match", [
    ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture.*LlamaForCausalLM"),
    ({"hidden_act": "gelu"}, "silu"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope type 'dynamic'"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"hidden_size": None}, "hidden_size=None is not an integer"),
    ({"vocab_size": "many"}, "vocab_size='many' is not an integer"),
])
def test_config_refusals(patch, match):
    cfg = tiny_config("qwen2").to_dict()
    cfg.update(patch)
    with pytest.raises(lean.UnsupportedModelError, match=match):
        config_from_hf(cfg)


# ---- loading -----------------------------------------------------------------------------------

def test_load_matches_hf_tensors(qwen3_dir):
    from safetensors.torch import load_file

    model = lean.load_model(qwen3_dir, dtype=torch.float32, device=DEVICE)
    ref = load_file(str(qwen3_dir / "model.safetensors"))
    ours = dict(model.hf_tensors())
    assert set(ours) == {k for k in ref if k != "lm_head.weight"}
    for k, t in ours.items():
        assert torch.equal(t.cpu(), ref[k]), k
    assert model.lm_head.data_ptr() == model.embed.data_ptr()  # tied: one tensor


def test_load_errors(tmp_path, qwen3_dir):
    from safetensors.torch import load_file, save_file

    with pytest.raises(lean.ModelLoadError, match="does not exist"):
        lean.load_model(tmp_path / "nope", device=DEVICE)
    (tmp_path / "empty").mkdir()
    with pytest.raises(lean.ModelLoadError, match="no config.json"):
        lean.load_model(tmp_path / "empty", device=DEVICE)

    def variant(name, tensors=None, raw=None):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((qwen3_dir / "config.json").read_text())
        if raw is not None:
            (d / "model.safetensors").write_bytes(raw)
        elif tensors is not None:
            save_file(tensors, str(d / "model.safetensors"))
        return d

    full = load_file(str(qwen3_dir / "model.safetensors"))
    blob = (qwen3_dir / "model.safetensors").read_bytes()
    with pytest.raises(lean.ModelLoadError, match="truncated"):
        lean.load_model(variant("trunc", raw=blob[: len(blob) // 2]), device=DEVICE)
    missing = {k: v for k, v in full.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(lean.ModelLoadError, match="missing 1 tensor.*layers.1.mlp.up_proj.*: re-download the model"):
        lean.load_model(variant("missing", missing), device=DEVICE)
    bad = dict(full)
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 64)
    with pytest.raises(lean.ModelLoadError, match=r"q_proj.weight has shape \(3, 64\)"):
        lean.load_model(variant("shape", bad), device=DEVICE)
    extra = dict(full)
    extra["model.layers.0.mlp.surprise"] = torch.zeros(2)
    with pytest.raises(lean.ModelLoadError, match="unexpected 1 tensor.*surprise"):
        lean.load_model(variant("extra", extra), device=DEVICE)
    d = variant("pickle")
    torch.save({}, d / "pytorch_model.bin")
    with pytest.raises(lean.ModelLoadError, match="pickle.*safetensors"):
        lean.load_model(d, device=DEVICE)
    d = variant("arch", full)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(lean.UnsupportedModelError, match="unsupported architecture"):
        lean.load_model(d, device=DEVICE)
    for key in ("hidden_size", "num_hidden_layers"):  # an incomplete config.json names the file and key
        d = variant(f"no-{key}", full)
        cfg = json.loads((d / "config.json").read_text())
        del cfg[key]
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(lean.UnsupportedModelError, match=f"config.json: no '{key}'.*re-download"):
            lean.load_model(d, device=DEVICE)
    sharded = variant("sharded", full)
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(lean.ModelLoadError, match="index.json is broken.*re-download"):
        lean.load_model(sharded, device=DEVICE)
    (sharded / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(lean.ModelLoadError, match="index.json is broken.*weight_map.*re-download"):
        lean.load_model(sharded, device=DEVICE)


# ---- batch descriptor ----------------------------------------------------------------------------

def test_pack_descriptor():
    docs = [[5, 6, 7], ([1, 2, 3, 4], [0, 0, 1, 1]), [9]]
    b = lean.pack(docs, max_tokens=10, device=DEVICE)
    assert b.ids.tolist() == [5, 6, 7, 1, 2, 3, 4, 9]
    assert b.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert b.cu_seqlens.tolist() == [0, 3, 7, 8]
    # targets never cross a document; masked tokens (1, 2) are not predicted
    assert b.targets.tolist() == [6, 7, -100, -100, 3, 4, -100, -100]
    assert b.max_seqlen == 4 and b.n_targets == 4 and b.n_tokens == 8
    p = lean.pack(docs, max_tokens=12, pad_to=12, device=DEVICE)
    assert p.n_tokens == 12 and p.cu_seqlens.tolist() == [0, 3, 7, 8, 12]
    assert p.targets.tolist()[8:] == [-100] * 4 and p.n_targets == 4


def test_pack_errors():
    with pytest.raises(lean.BatchError, match="empty batch"):
        lean.pack([], max_tokens=8, device=DEVICE)
    with pytest.raises(lean.BatchError, match="document 1 has 9 tokens.*max_tokens=8"):
        lean.pack([[1], list(range(9))], max_tokens=8, device=DEVICE)
    with pytest.raises(lean.BatchError, match="12 tokens, more than max_tokens=10"):
        lean.pack([[1] * 6, [2] * 6], max_tokens=10, device=DEVICE)
    with pytest.raises(lean.BatchError, match="loss mask has 2 entries for 3 tokens"):
        lean.pack([([1, 2, 3], [1, 1])], max_tokens=8, device=DEVICE)
    with pytest.raises(lean.BatchError, match="out of range"):
        lean.pack([[1, 2, 300]], max_tokens=8, device=DEVICE, vocab=100)
    with pytest.raises(lean.BatchError, match="device 'meta': lean's kernels run on a CUDA GPU or"):
        lean.pack([[1, 2]], max_tokens=8, device="meta")   # it landed on the CPU, unsaid


# ---- adapters ----------------------------------------------------------------------------------

def test_lora_init_matches_peft_init_distribution(qwen3_dir):
    model = lean.load_model(qwen3_dir, dtype=torch.float32, device=DEVICE)
    lora = lean.LoRA.init(model, r=8, alpha=16, targets=["q_proj", "down"], seed=3)
    assert lora.targets == ("q", "down") and lora.scale == 2.0
    for layer in lora.layers:
        for t, ad in layer.items():
            bound = 1 / np.sqrt(ad.a.shape[1])
            assert ad.a.abs().max() <= bound and ad.a.abs().max() > 0.5 * bound
            assert torch.count_nonzero(ad.b) == 0
    again = lean.LoRA.init(model, r=8, alpha=16, targets=["q_proj", "down"], seed=3)
    assert torch.equal(again.params, lora.params)
    assert lean.LoRA.init(model, r=8, alpha=16, use_rslora=True).scale == pytest.approx(16 / np.sqrt(8))
    with pytest.raises(lean.LoRAError, match="unknown LoRA target 'lm_head'"):
        lean.LoRA.init(model, targets=["lm_head"])


def test_adapter_round_trip_with_peft(tmp_path, qwen3_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = lean.load_model(qwen3_dir, dtype=torch.float32, device=DEVICE)
    lora = lean.LoRA.init(model, r=4, alpha=8, targets="q,v,up", seed=1)
    lora.params.add_(0.01)  # non-zero B
    lora.sync_lowp()
    lora.save(tmp_path / "ours")
    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, torch_dtype=torch.float32)
    pm = PeftModel.from_pretrained(hf, tmp_path / "ours")
    theirs = {k.replace(".default", ""): v for k, v in pm.state_dict().items() if "lora_" in k}
    ours = lora.state_dict()
    assert set(theirs) == set(ours)
    for k in ours:
        assert torch.equal(theirs[k].cpu(), ours[k].cpu()), k
    # transformers + PEFT with lean's saved adapter gives lean's logits
    docs = [[3, 17, 5, 99, 42, 7, 8], [11, 12, 13]]
    ours_logits = lean.forward(model, lora, lean.pack(docs, max_tokens=16, device=DEVICE)).cpu()
    with torch.no_grad():
        ref = torch.cat([pm(input_ids=torch.tensor([d])).logits[0] for d in docs])
    assert (ours_logits - ref).abs().max() <= 1e-5 * ref.abs().max()
    # and back: PEFT saves, lean loads the same numbers and gives the same logits
    pm.save_pretrained(tmp_path / "theirs")
    back = lean.LoRA.load(model, tmp_path / "theirs")
    assert back.targets == lora.targets and back.r == 4 and back.scale == lora.scale
    assert torch.equal(back.params, lora.params)
    back_logits = lean.forward(model, back, lean.pack(docs, max_tokens=16, device=DEVICE)).cpu()
    assert torch.equal(back_logits, ours_logits)
    # PEFT's "all-linear" (saved as full module paths) and rsLoRA load: every projection, PEFT's scale
    from peft import LoraConfig, get_peft_model
    hf2 = AutoModelForCausalLM.from_pretrained(qwen3_dir, torch_dtype=torch.float32)
    pm2 = get_peft_model(hf2, LoraConfig(r=3, lora_alpha=5, target_modules="all-linear", use_rslora=True))
    pm2.save_pretrained(tmp_path / "all-linear")
    every = lean.LoRA.load(model, tmp_path / "all-linear")
    assert every.targets == lean.runtime.lora.TARGETS and abs(every.scale - 5 / 3 ** 0.5) < 1e-12


def test_adapter_errors(tmp_path, qwen3_dir):
    model = lean.load_model(qwen3_dir, dtype=torch.float32, device=DEVICE)
    with pytest.raises(lean.LoRAError, match="not a PEFT LoRA adapter"):
        lean.LoRA.load(model, tmp_path)
    lora = lean.LoRA.init(model, r=4, alpha=8, seed=0)
    lora.save(tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(lean.LoRAError, match="use_dora"):
        lean.LoRA.load(model, tmp_path / "a")
    assert not list((tmp_path / "a").glob("*.tmp"))  # atomic writes leave no temporaries

    from safetensors.torch import load_file, save_file

    def variant(name, cfg_edit=None, tensors_edit=None, raw_cfg=None):
        d = tmp_path / name
        lora.save(d)
        if raw_cfg is not None:
            (d / "adapter_config.json").write_text(raw_cfg)
        if cfg_edit is not None:
            c = json.loads((d / "adapter_config.json").read_text())
            cfg_edit(c)
            (d / "adapter_config.json").write_text(json.dumps(c))
        if tensors_edit is not None:
            t = load_file(str(d / "adapter_model.safetensors"))
            tensors_edit(t)
            save_file(t, str(d / "adapter_model.safetensors"))
        return d

    # PEFT features that change the computation are refused by name, never dropped
    for key, val in (("lora_bias", True), ("trainable_token_indices", [3, 5]), ("layer_replication", [[0, 2]]),
                     ("alpha_pattern", {"q_proj": 4})):
        with pytest.raises(lean.LoRAError, match=f"{key}=.*merge this adapter with PEFT"):
            lean.LoRA.load(model, variant(key, cfg_edit=lambda c: c.update({key: val})))
    head = "base_model.model.lm_head.lora_A.weight"
    with pytest.raises(lean.LoRAError, match="1 tensor.*would not apply.*lm_head"):
        lean.LoRA.load(model, variant("lm", tensors_edit=lambda t: t.update({head: torch.zeros(4, 8)})))
    # tensors lean would not apply: a deeper model's layer, a LoRA bias
    key = "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"
    with pytest.raises(lean.LoRAError, match="1 tensor.*would not apply.*layers.7.*deeper or other model"):
        lean.LoRA.load(model, variant("deep", tensors_edit=lambda t: t.update({key: torch.zeros(4, 8)})))
    gone = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    with pytest.raises(lean.LoRAError, match="missing 1 LoRA tensor.*covers fewer layers or modules"):
        lean.LoRA.load(model, variant("shallow", tensors_edit=lambda t: t.pop(gone)))
    with pytest.raises(lean.LoRAError, match="adapter_config.json is not a PEFT adapter config.*save the adapter again"):
        lean.LoRA.load(model, variant("badjson", raw_cfg="{"))
    with pytest.raises(lean.LoRAError, match="no 'r'"):
        lean.LoRA.load(model, variant("nor", cfg_edit=lambda c: c.pop("r")))
    c8 = variant("noalpha", cfg_edit=lambda c: c.pop("lora_alpha"))
    assert lean.LoRA.load(model, c8).scale == 8 / 4  # PEFT's default lora_alpha
    for kw, match in ((dict(targets=""), "no LoRA target"), (dict(targets=[]), "no LoRA target"),
                      (dict(alpha=0), "alpha=0: must be > 0"), (dict(r=2.5), "r=2.5: must be an integer")):
        with pytest.raises(lean.LoRAError, match=match):
            lean.LoRA.init(model, **{"r": 4, "alpha": 8, **kw})


def test_hub_id_unreachable_names_the_fix(monkeypatch):
    """A hub id goes through huggingface_hub; when it cannot be fetched the error says what to do."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(lean.ModelLoadError, match="(?s)could not fetch 'no-such-org/no-such-model'.*local folder"):
        lean.load_model("no-such-org/no-such-model", device=DEVICE)


def test_adamw_wrapper_matches_torch(qwen3_dir):
    """lean.AdamW over the flat LoRA buffer: three steps with a changing lr equal torch's AdamW +
    clip_grad_norm_ on the same gradients."""
    model = lean.load_model(qwen3_dir, dtype=torch.float32, device=DEVICE)
    lora = lean.LoRA.init(model, r=4, alpha=8, seed=2)
    ref = torch.nn.Parameter(lora.params.detach().clone())
    opt = lean.AdamW(lora, lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    topt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1)
    g = torch.Generator(device=DEVICE).manual_seed(5)
    for step, lr in enumerate([1e-2, 5e-3, 2e-3]):
        grads = torch.randn(lora.numel, generator=g, device=DEVICE)
        lora.grads.copy_(grads)
        opt.step(lr=lr)
        ref.grad = grads.clone()
        norm = torch.nn.utils.clip_grad_norm_([ref], 0.5)
        for group in topt.param_groups:
            group["lr"] = lr
        topt.step()
        assert torch.allclose(opt.grad_norm, norm.reshape(1), rtol=1e-5)
        assert (lora.params - ref.detach()).abs().max() <= 1e-6 * ref.detach().abs().max(), step


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # tied and untied lm_head
def test_merge_writes_a_folder_transformers_loads(tmp_path, arch):
    """W + scale * B A folded in: transformers on the merged folder gives the adapted logits."""
    from transformers import AutoModelForCausalLM

    from lean.runtime.merge import merge_and_save

    build_hf(arch, 4).save_pretrained(tmp_path / "base")
    model = lean.load_model(tmp_path / "base", dtype=torch.float32, device=DEVICE)
    lora = lean.LoRA.init(model, r=4, alpha=8, targets="q,k,o,down", seed=4)
    g = torch.Generator().manual_seed(4)
    lora.params.copy_(lora.params + 0.05 * torch.randn(lora.params.shape, generator=g).to(lora.params.device))
    lora.sync_lowp()
    out = merge_and_save(model, lora, tmp_path / "merged", dtype="float32")
    assert not list(tmp_path.glob("merged.tmp-*"))
    docs = [[3, 17, 5, 99, 42, 7, 8], [11, 12, 13]]
    adapted = lean.forward(model, lora, lean.pack(docs, max_tokens=16, device=DEVICE)).cpu()
    base = lean.forward(model, None, lean.pack(docs, max_tokens=16, device=DEVICE)).cpu()
    assert (adapted - base).abs().max() > 1e-3  # the adapter matters, so the check below can fail
    hf = AutoModelForCausalLM.from_pretrained(out).eval()  # the merge's dtype by default, no dtype=
    assert hf.dtype == torch.float32
    with torch.no_grad():
        ref = torch.cat([hf(input_ids=torch.tensor([d])).logits[0] for d in docs])
    assert (ref - adapted).abs().max() <= 1e-5 * adapted.abs().max()
    bf16 = merge_and_save(model, lora, tmp_path / "merged", dtype="bfloat16", overwrite=True)
    assert AutoModelForCausalLM.from_pretrained(bf16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="exists and is not empty.*overwrite=True"):
        merge_and_save(model, lora, tmp_path / "merged")
    with pytest.raises(ValueError, match="the model's own folder"):
        merge_and_save(model, lora, tmp_path / "base", overwrite=True)
    with pytest.raises(ValueError, match="holds the model's own folder"):  # a parent of it
        merge_and_save(model, lora, tmp_path, overwrite=True)
