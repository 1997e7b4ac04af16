"""The step bench's harness on the CPU (tools/bench_step.py, bench_peers.py, bench_profile.py): the MoE
models' HF+PEFT rows (LoRA on q,k,v,o and on every expert through PEFT target_parameters, the packed
rows kept apart, one step), the row protocol of a child process, the table's lean baselines per LoRA
placement, the attention-only lean row a peer's attention-only row brings, and the profile's routing
summary from a synthetic trace. Tiny configs (bench_step's --smoke sizes); seconds, no interpreter."""
import os
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)
pytest.importorskip("peft")

import bench_peers  # noqa: E402
import bench_profile  # noqa: E402
import bench_step  # noqa: E402

MOE = ("qwen3-30b-a3b", "gpt-oss-20b")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _peft_moe(name):
    import torch

    model = bench_peers.build_hf(name, True, "cpu", torch.float32, "grouped_mm")
    return bench_peers.peft_wrap(model, moe=True)


@pytest.mark.parametrize("name", MOE)
def test_hf_moe_lora_on_attention_and_experts(name):
    """Every trainable parameter is a LoRA factor of q,k,v,o or of a layer's experts; every layer has
    both (gate_up and down: two ParamWrappers); gate_up's rank is what PEFT's own mapping of the 7
    names gives (Qwen3-MoE 2r) or r (GPT-OSS, whose names PEFT does not map), as lean's adapters."""
    from peft import LoraConfig, get_peft_model

    pm = _peft_moe(name)
    trainable = {n: tuple(p.shape) for n, p in pm.named_parameters() if p.requires_grad}
    stray = [n for n in trainable if "lora_" not in n or not (".mlp.experts." in n or any(f".self_attn.{t}." in n
                                                                                         for t in ATTN))]
    assert not stray, stray
    layers = pm.config.num_hidden_layers
    for li in range(layers):
        mine = [n for n in trainable if f".layers.{li}." in n]
        assert sum(".mlp.experts." in n and "lora_A" in n for n in mine) == 2, mine  # gate_up and down
        assert all(any(f".self_attn.{t}.lora_A" in n for n in mine) for t in ATTN), mine
    ranks = "gate_up r32, down r16" if name.startswith("qwen3") else "gate_up r16, down r16"
    assert bench_peers.lora_placement(pm) == ("all", f"attn + experts ({ranks})")
    cfg = pm.config
    E = cfg.num_experts if name.startswith("qwen3") else cfg.num_local_experts
    gate_up_rows = {trainable[n][0] for n in trainable if ".mlp.experts.base_layer.lora_A" in n}  # gate_up: inner
    assert gate_up_rows == {(32 if name.startswith("qwen3") else 16) * E}
    if name.startswith("qwen3"):  # PEFT maps the 7 names onto the experts itself: the same adapters
        plain = bench_peers.build_hf(name, True, "cpu", pm.dtype, "grouped_mm")
        ref = get_peft_model(plain, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                               target_modules=bench_peers.TARGETS))
        assert {n: tuple(p.shape) for n, p in ref.named_parameters() if p.requires_grad} == trainable
        assert ref.peft_config["default"].alpha_pattern == {bench_peers.GATE_UP_PATTERN: 64}


@pytest.mark.parametrize("name,framework", [(m, "hf") for m in MOE] + [("qwen3-30b-a3b", "hf-default")])
def test_hf_moe_row_runs(name, framework):
    """The HF+PEFT MoE row under --smoke: packed isolation checked (GPT-OSS through transformers' own
    mask mapping), one step, the note naming the LoRA placement and the experts implementation."""
    row = bench_peers.run_hf(name, "packed", 0, 1, smoke=True, framework=framework)
    assert row.get("status", "ok") == "ok", row
    assert row["lora"] == "all" and row["loss"] > 0
    assert row["note"].startswith("LoRA attn + experts (PEFT target_parameters; gate_up r")
    assert "grouped_mm" in row["note"] and "packed isolation checked" in row["note"]
    if framework == "hf-default":
        assert "default experts implementation" in row["note"]


def test_moe_row_child_process():
    """bench_step.run_child -> tools/bench_peers.py -> one ROW line (gpt-oss-20b, HF+PEFT, packed)."""
    row = bench_step.run_child("hf", "gpt-oss-20b", "packed", steps=1, warmup=0, smoke=True, graph=False, timeout=120)
    assert row.get("status", "ok") == "ok", row
    assert row["lora"] == "all" and "experts" in row["note"]


def test_moe_layer_cut():
    """The MoE models are cut to 8 layers for every framework; GPT-OSS's layer_types follows the cut."""
    for name in ("qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-20b-mxfp4"):
        assert bench_step.layers(name) == 8
        cfg = bench_step.model_config(name)
        assert cfg["num_hidden_layers"] == 8 and len(cfg.get("layer_types", [0] * 8)) == 8
    assert bench_step.layers_note("qwen3-30b-a3b") == "8 of 48 layers"


def _row(fw, tps, lora="all", model="m", layout="packed"):
    return dict(status="ok", framework=fw, model=model, layout=layout, tokens_per_s=tps, mfu=0.1, peak_gib=1.0,
                lora=lora, note="")


@pytest.mark.parametrize("name", ["qwen3-0.6b", *MOE])
def test_peer_folder_loads_every_tensor(name, tmp_path, monkeypatch):
    """Unsloth's input folder, written tensor by tensor in small shards (tied embeddings: Qwen3-0.6B;
    MoE expert stacks), loads in transformers with no tensor missing or left over, the values drawn."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(bench_peers, "FOLDERS", str(tmp_path))
    monkeypatch.setattr(bench_peers, "SHARD_BYTES", 1 << 16)
    bench_peers.write_folder(name, smoke=True)
    folder = bench_peers.folder_path(name, True)
    assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 1
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    built = bench_peers.build_hf(name, True, "cpu", torch.float32)
    assert set(model.state_dict()) == set(built.state_dict())
    for key, t in model.state_dict().items():
        if t.dim() >= 2:
            assert 0.005 < t.float().std() < 0.1, key
        elif "norm" in key:
            assert torch.equal(t, torch.ones_like(t)), key
    assert AutoTokenizer.from_pretrained(folder).pad_token_id == 1


def test_table_compares_like_with_like():
    """A peer with attention-only LoRA is compared with lean's attn-LoRA row, the others with lean's."""
    rows = [_row("lean", 100.0), _row("lean+graph", 200.0), _row("lean attn-LoRA", 400.0, "attn"),
            _row("HF+PEFT", 50.0), _row("Unsloth", 100.0, "attn")]
    table = bench_step.fmt_table(rows).splitlines()
    line = lambda fw: next(ln for ln in table if f" {fw} " in ln)  # noqa: E731
    assert "4.00x" in line("HF+PEFT") and "4.00x" in line("Unsloth")  # 200 / 50 and 400 / 100


def test_attention_only_peer_brings_lean_attn(monkeypatch):
    """bench_step.main: an MoE peer row that came back attention-only runs lean's attention-only row."""
    calls = []

    def fake_child(fw, model, layout, *a, **k):
        calls.append(fw)
        attn = fw in ("unsloth", "lean-attn")
        return dict(tokens=64, ms=1.0, loss=1.0, checkpointing=False, wall_s=0.0, lora="attn" if attn else "all",
                    note="")

    monkeypatch.setattr(bench_step, "run_child", fake_child)
    monkeypatch.setattr(bench_step, "measure_matmul", lambda smoke: 1.0)
    rows = bench_step.main(["qwen3-30b-a3b"], ["packed"], ["hf", "unsloth"], steps=1, smoke=True)
    assert calls == ["lean", "hf", "unsloth", "lean-attn"]
    assert [r["framework"] for r in rows] == ["lean", "HF+PEFT", "Unsloth", "lean attn-LoRA"]
    calls.clear()
    bench_step.main(["qwen3-0.6b"], ["packed"], ["hf", "hf-default"], steps=1, smoke=True)
    assert calls == ["lean", "hf"]  # hf-default: MoE models only


def _trace():
    """Two steps' worth: a layer range holding a block range holding the router's range, on thread 1."""
    ev = []

    def rng(name, ts, dur):
        ev.append(dict(cat="user_annotation", name=name, ts=ts, dur=dur, tid=1))

    def kernel(name, corr, ts, dur, launch_ts):
        ev.append(dict(cat="cuda_driver", name="cuLaunchKernelEx", ts=launch_ts, dur=1, tid=1,
                       args=dict(correlation=corr)))
        ev.append(dict(cat="kernel", name=name, ts=ts, dur=dur, tid=7, args=dict(correlation=corr)))

    rng("bench:moe_layer", 0, 100)
    rng("bench:moe_block", 10, 80)
    rng("bench:router_gemm", 12, 3)
    kernel("_matmul_kernel", 1, 1000, 4.0, 13)  # the router GEMM
    kernel("_route_fwd_kernel", 2, 1010, 1.0, 20)
    kernel("_group_hist_kernel", 3, 1020, 1.0, 21)
    kernel("_grouped_gemm_kernel", 4, 1030, 40.0, 30)
    kernel("_attention_fwd_kernel", 5, 1080, 34.0, 5)  # in the layer, not the block
    kernel("_adamw_update_kernel", 6, 1200, 20.0, 150)  # outside every range
    kernel("_moe_aux_kernel", 7, 1300, 2.0, 160)
    return dict(traceEvents=ev)


def test_routing_summary_from_ranges():
    events = bench_profile.gpu_events(_trace())
    fams = {e[1]: e[0] for e in events}
    assert fams["_matmul_kernel"] == "router_gemm" and fams["_attention_fwd_kernel"] == "_attention_fwd"
    b = bench_profile.breakdown(events, steps=1, step_ms=0.2, moe=True)
    r = b["routing"]
    assert r["basis"] == "ranges"
    assert r["ms"] == pytest.approx(8e-3)  # 4 + 1 + 1 + 2 us
    assert r["layers_ms"] == pytest.approx(80e-3) and r["layers_pct"] == pytest.approx(100 * 6 / 80)
    assert r["blocks_ms"] == pytest.approx(46e-3) and r["blocks_pct"] == pytest.approx(100 * 6 / 46)
    assert "of the MoE layers' kernel time" in bench_profile.fmt(b, "t")


def test_routing_summary_without_ranges():
    """A graph's trace (no host ranges): routing without the router GEMM, against the kernels less the
    embedding, lm_head + loss and optimizer families."""
    trace = _trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["cat"] != "user_annotation"]
    events = bench_profile.gpu_events(trace)
    r = bench_profile.breakdown(events, steps=1, step_ms=0.2, moe=True)["routing"]
    assert r["basis"] == "families" and "router_gemm" not in r["families"]
    assert r["ms"] == pytest.approx(4e-3) and r["layers_ms"] == pytest.approx(82e-3)


def test_dist_launch_keeps_a_row_printed_before_a_hang():
    """bench_dist._launch: ranks that printed their ROW and then hung on the way out (as in a process
    group that cannot be destroyed) give the row, the hang noted; ranks that printed none give a
    failed row with their progress tail; a clean exit gives the row as is."""
    import bench_dist

    row = '{"framework": "lean", "tokens_per_s": 5.0}'
    py = [sys.executable, "-I", "-S"]  # no site, no .pth files: the child prints within the 5 s however loaded
    hang = [*py, "-c", f"import sys, time; print('ROW {row}', flush=True); "
            "print('[rank 0] closing', file=sys.stderr, flush=True); time.sleep(60)"]
    got = bench_dist._launch(hang, 5, dict(os.environ))
    assert got["status"] == "ok" and got["tokens_per_s"] == 5.0
    assert "killed at 5 s after the row" in got["note"] and "[rank 0] closing" in got["note"]
    silent = [*py, "-c", "import sys, time; print('[rank 1] timing', file=sys.stderr, flush=True); "
              "time.sleep(60)"]
    got = bench_dist._launch(silent, 5, dict(os.environ))
    assert got["status"] == "failed" and "killed at 5 s" in got["note"] and "[rank 1] timing" in got["note"]
    clean = [*py, "-c", f"print('ROW {row}')"]
    assert bench_dist._launch(clean, 30, dict(os.environ)) == {"framework": "lean", "tokens_per_s": 5.0, "status": "ok"}
