"""Data parallel on the CPU: lean-train in 2 and 3 processes (gloo, the Triton interpreter) against
one process over the same micro-batches.

Every rank is a tests.dist_worker process with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, a free MASTER_PORT), forked from a forkserver that has imported torch and lean once
(run_ranks), on tiny random Llama and Qwen2 models (tests/hf_models.py's, with 2 query heads: the
interpreter's cost is per head), in float32, with LoRA dropout on (each rank must draw the seeds of
its global micro-batches). The reference is train() in this process with grad_accum = world x the
ranks' grad_accum.
Covers: 2 ranks == one process bit for bit (the sum of two partial gradients is one commutative
add) through a SIGINT that reaches rank 1 alone, mid-step (both stop at the step's exchange, rank
0 saves the step before) and a resume by lean-train's own main, with the same losses, held-out
losses and one metrics record a step, while the other ranks' writers raise (only rank 0 writes);
resuming under another world size (refused unless world x grad_accum stays, then exact); 3 ranks
with sharded weights == one process to fp32 rounding (the gradient sums in another order), with
sharded evaluation rounds; a rank killed mid-step (the other exits naming it, found by the closed
connection long before --dist-timeout), a NaN on one rank and an OOM in one rank's backward with
sharded weights and two micro-batches a rank (every rank stops with the same message; the OOM
keeps the last completed step); tools/train_lora.py under torchrun itself; in this process: the
signal handler, the collectives' error classes, nested agreements, step_ends, the gradient
buckets, the host counts, the gathers' rotation.
Slow: each rank runs the interpreter (about 2 min 30 s and 160 CPU-s on 2 cores others were using).
"""
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import lean.runtime.train as T
from lean.runtime.batch import count_tokens, pack
from lean.runtime.dist import Dist, RankLost
from lean.runtime.grad_reduce import GradReducer
from tests.hf_models import build_hf, tiny_config
from tests.test_train import _records, _write_tokenizer
from tests.util import fresh_generator

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU processes of data parallel (gloo, the "
                                "interpreter); on GPUs tests/test_dist_gpu.py runs the same checks")
ROOT = Path(__file__).resolve().parents[1]
DEADLINE = 600  # seconds a multi-process run may take before the test calls it hung
TIMEOUT = 180  # --dist-timeout of the runs: a rank may wait this long for a slower one (2 loaded cores)


def _two_heads(arch, **kw):
    """tiny_config with 2 query heads and 1 KV head (head dim 32): the interpreter runs an attention
    or RoPE program per head, so half of tests/test_train.py's 4 heads makes every pass cheaper."""
    cfg = tiny_config(arch)
    return cfg.__class__(**dict(cfg.to_dict(), num_attention_heads=2, num_key_value_heads=1,
                                head_dim=cfg.hidden_size // 2, **kw))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    rng = np.random.default_rng(int(torch.randint(1 << 30, (1,), generator=fresh_generator("cpu"))))
    build_hf("llama", int(rng.integers(1 << 30)), config=_two_heads("llama")).save_pretrained(root / "model")
    _write_tokenizer(root / "model")
    # 3 layers for sharded weights: the two gather buffers are refilled while the step runs (with 2,
    # both layers would stay gathered after the first forward)
    build_hf("llama", int(rng.integers(1 << 30)), config=_two_heads("llama", num_hidden_layers=3)
             ).save_pretrained(root / "model3")
    _write_tokenizer(root / "model3")
    # Qwen2 (q/k/v biases): a layer of 27,904 values, which 3 ranks split with padding
    build_hf("qwen2", int(rng.integers(1 << 30)), config=_two_heads("qwen2")).save_pretrained(root / "qwen2")
    _write_tokenizer(root / "qwen2")
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(rng)))
    return root, int(rng.integers(1000))


def _cfg(setup, out, **kw):
    root, seed = setup
    base = dict(model=str(root / "model"), data=str(root / "data.jsonl"), out_dir=str(root / out), max_tokens=32,
                steps=2, lr=1e-1, warmup_steps=1, r=4, alpha=8, targets=["down"], dropout=0.1, seed=seed,
                eval_every=0, save_every=0, heldout_fraction=0.0, heldout_tokens=16, progress=False, sample_tokens=0,
                tensorboard=False, dist_timeout=TIMEOUT)  # held out (where a test holds out): one document
    base.update(kw)
    return base


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _forkserver():
    """The multiprocessing context whose server has imported torch, lean and the worker once: each
    rank is forked from it (a fresh interpreter would spend ~2.3 CPU-s importing torch)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.dist_worker", "lean.runtime.train"])
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the server's BLAS and torch thread pools: one thread, as in a rank
    try:
        from multiprocessing import forkserver
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before
    return ctx


@pytest.fixture(scope="module", autouse=True)
def _forkserver_stops():
    """After the module: the forkserver stops and is waited for (it has reaped its ranks), so their
    CPU time counts as this process's children's (/usr/bin/time) and no server is left behind."""
    yield
    from multiprocessing import forkserver
    forkserver._forkserver._stop()  # private, stable since 3.8: the one way to wait for the server


def run_ranks(world, cfg, fault=None, deadline=DEADLINE, ended=None, cli=False, head_rows=None):
    """Start `world` ranks of tests.dist_worker; [(returncode, stdout, stderr)] per rank. Each is
    reaped as it ends (ended: a list that gets each rank's end time); past the deadline every rank
    is killed and the test fails (a hang). On the CPU the ranks are forked from _forkserver; on a
    GPU each is a fresh `python -m tests.dist_worker` (no CUDA state may cross a fork).
    cli: every rank runs lean-train's main on cfg's settings as flags (tests/dist_worker.py).
    head_rows: the lm_head's chunk rows (a sharded head: several chunks of a tiny vocabulary)."""
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")  # TRITON_INTERPRET as conftest set it (CPU only)
    spec = {"cfg": cfg, "fault": fault, "cli": cli, "head_rows": head_rows}
    logs = Path(cfg["out_dir"] + ".logs")
    logs.mkdir(parents=True, exist_ok=True)
    fork = not torch.cuda.is_available()
    ctx = _forkserver() if fork else None
    procs = []
    for r in range(world):
        mine = dict(env, RANK=str(r), LOCAL_RANK=str(r))
        if fork:
            from tests.dist_worker import forked
            p = ctx.Process(target=forked, args=(spec, mine, str(logs / f"out.{r}"), str(logs / f"err.{r}")))
            p.start()
        else:
            with open(logs / f"out.{r}", "w") as out, open(logs / f"err.{r}", "w") as err:
                p = subprocess.Popen([sys.executable, "-m", "tests.dist_worker", json.dumps(spec)], cwd=ROOT,
                                     stdout=out, stderr=err, env=dict(os.environ, **mine))
        procs.append(p)
    start, done = time.monotonic(), {}  # monotonic: one clock with dist_worker's (Linux: system-wide)
    while len(done) < world:
        for r, p in enumerate(procs):
            if r not in done and (p.exitcode if fork else p.poll()) is not None:
                done[r] = time.monotonic()
        if time.monotonic() - start > deadline:
            for p in procs:
                p.kill()
            pytest.fail(f"{world} ranks still running after {deadline} s: a rank hangs")
        time.sleep(0.1)
    if ended is not None:
        ended.extend(done[r] for r in range(world))
    return [(p.exitcode if fork else p.returncode, (logs / f"out.{r}").read_text(), (logs / f"err.{r}").read_text())
            for r, p in enumerate(procs)]


def _ok(results):
    for r, (rc, _, err) in enumerate(results):
        assert rc == 0, f"rank {r} exited {rc}: {err[-3000:]}"
    return json.loads(results[0][1].strip().splitlines()[-1])


def _state(out):
    return load_file(str(Path(out) / "checkpoint" / "state.safetensors"))


def _records_of(out, kind):
    lines = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["kind"] == kind]


def _error_line(err):
    return next(x for x in err.splitlines() if ": error: " in x).split(": error: ", 1)[1]


@pytest.fixture(scope="module")
def two_ranks(setup):
    """One process with grad_accum 2 (the reference), and 2 ranks stopped by a SIGINT to rank 1
    alone in its step 2 (the checkpoint of step 1 copied aside), then resumed to step 2 by
    lean-train's own main (its flags, lines and exit status under torchrun's environment)."""
    ref = _cfg(setup, "ref2", grad_accum=2, heldout_fraction=0.2, save_every=2)
    ref_result = T.train(T.TrainConfig(**ref))
    dp = _cfg(setup, "dp2", heldout_fraction=0.2, save_every=2)
    stopped = run_ranks(2, dp, fault={"kind": "signal", "rank": 1, "step": 2})
    at_1 = Path(dp["out_dir"] + ".at1")
    shutil.copytree(dp["out_dir"], at_1)
    resumed = run_ranks(2, dict(dp, resume=True), cli=True)
    return ref, ref_result, dp, stopped, resumed, at_1


def test_two_ranks_equal_one_process_through_a_resume(two_ranks):
    """The SIGINT reaches rank 1 mid-step; rank 0 gets none: both finish the step's compute, stop at
    its exchange with the parameters of step 1, and say the same (rank 0 saved step 1)."""
    ref, ref_result, dp, stopped, resumed, _ = two_ranks
    assert [rc for rc, _, _ in stopped] == [130, 130], [e[-2000:] for _, _, e in stopped]
    said = [err.split(": interrupted: ", 1)[1].strip() for _, _, err in stopped]
    assert said[0] == said[1], said
    assert said[0].startswith("interrupted after step 1 (SIGINT to rank 1): checkpoint of step 1 saved in "), said[0]
    assert [rc for rc, _, _ in resumed] == [0, 0], [e[-2000:] for _, _, e in resumed]
    done = (f"lean-train: done: step 2, loss {ref_result['loss']:.4f}, held-out {ref_result['eval_loss']:.4f}, "
            "adapter in ")
    assert resumed[0][1].startswith(done) and resumed[1][1] == "", [o for _, o, _ in resumed]  # rank 0 speaks
    a, b = _state(ref["out_dir"]), _state(dp["out_dir"])
    for k in ("params", "m", "v"):
        assert torch.equal(a[k], b[k]), k  # bit for bit: 2 partial gradients add in one commutative add
    losses = lambda out: [(r["step"], r["loss"], r["grad_norm"], r["targets"], r["tokens"])  # noqa: E731
                          for r in _records_of(out, "train")]
    assert losses(dp["out_dir"]) == losses(ref["out_dir"])  # one record a step: rank 0's, the global values
    assert [(r["step"], r["loss"]) for r in _records_of(dp["out_dir"], "eval")] == \
        [(r["step"], r["loss"]) for r in _records_of(ref["out_dir"], "eval")] == \
        [(0, ref_result["eval_loss_before"]), (2, ref_result["eval_loss"])]
    state = json.loads((Path(dp["out_dir"]) / "checkpoint" / "state.json").read_text())
    assert (state["world_size"], state["lora_steps"]) == (2, 4)
    assert (Path(dp["out_dir"]) / "adapter" / "adapter_model.safetensors").is_file()


def test_resume_under_another_world_size(two_ranks):
    """The 2-rank checkpoint of step 1: one process with grad_accum 1 is refused, naming both sizes
    and the fix; with grad_accum 2 it maps exactly and ends where the reference did."""
    ref, _, dp, _, _, at_1 = two_ranks
    cfg = T.TrainConfig(**dict(dp, out_dir=str(at_1), resume=True))
    with pytest.raises(T.TrainError, match=r"made by 2 process\(es\) x --grad-accum 1 = 2 micro-batches a step, "
                                           r"this run is 1 x 1 = 1.*pass --grad-accum 2 with these 1 processes"):
        T.train(cfg)
    cfg.grad_accum = 2
    T.train(cfg)
    a, b = _state(ref["out_dir"]), _state(at_1)
    assert torch.equal(a["params"], b["params"]) and torch.equal(a["v"], b["v"])


def test_three_ranks_with_sharded_weights_equal_one_process(setup):
    """A Qwen2 layer's weights in thirds (27,904 values: the last part zero-padded), gathered one
    layer ahead, forward and backward; the held-out batch evaluated by rank 0 while ranks 1 and 2
    run filler passes (each pass gathers every layer together). To fp32 rounding: 3 partial
    gradients sum in gloo's order, not the reference's. The parameters' bound, steps x lr x 2^-14,
    is 4 orders below what a wrong seed, bucket or gathered weight moves one (about lr a step); a
    wrong gradient scale does not move them (AdamW with clipping is scale-invariant), so the grad
    norms are compared too. The lm_head sharded too (shard.ShardHead, in 3 chunks): the loss's
    log-sum-exp runs chunk by chunk, another order than the whole head's fused kernel, so even the
    losses before any update (step 1's, the held-out loss before training) agree to fp32 rounding
    (rel 1e-6), as do those after one."""
    qwen2 = str(setup[0] / "qwen2")
    ref = _cfg(setup, "ref3", grad_accum=3, save_every=2, heldout_fraction=0.2, model=qwen2)
    T.train(T.TrainConfig(**ref))
    dp = _cfg(setup, "dp3", save_every=2, heldout_fraction=0.2, shard_weights=True, model=qwen2)
    _ok(run_ranks(3, dp, head_rows=48))  # the lm_head in 3 chunks of 3 x 16 rows (shard.ShardHead)
    a, b = _state(ref["out_dir"]), _state(dp["out_dir"])
    torch.testing.assert_close(b["params"], a["params"], rtol=0, atol=2 * 1e-1 * 2**-14)
    got, want = _records_of(dp["out_dir"], "train"), _records_of(ref["out_dir"], "train")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in want], rel=1e-5)
    got, want = _records_of(dp["out_dir"], "eval"), _records_of(ref["out_dir"], "eval")
    assert [(r["step"], r["targets"]) for r in got] == [(r["step"], r["targets"]) for r in want] == \
        [(0, want[0]["targets"]), (2, want[0]["targets"])] and want[0]["targets"] > 0
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6)


def test_a_killed_rank_stops_the_other(setup):
    """Found by the closed connection (gloo), not by the timeout: the survivor exits naming the dead
    rank well before the --dist-timeout of 900 s (within a few seconds here)."""
    dp = _cfg(setup, "killed", dist_timeout=900)
    ended = []
    (rc0, _, err0), (rc1, _, _) = run_ranks(2, dp, fault={"kind": "kill", "rank": 1, "step": 2}, ended=ended)
    assert rc1 == -signal.SIGKILL and rc0 == 2, err0[-2000:]
    msg = _error_line(err0)
    assert "rank 1 (PID" in msg and "exited during" in msg, msg
    assert "the checkpoint of step 1 is saved" in msg and "--resume" in msg, msg
    assert json.loads((Path(dp["out_dir"]) / "checkpoint" / "state.json").read_text())["step"] == 1
    after = ended[0] - float((Path(dp["out_dir"] + ".logs") / "killed_at").read_text())
    print(f"the survivor stopped {after:.1f} s after the kill")
    assert 0 < after < 450, after  # its step's compute and the save; the timeout would be 900 s


def test_nan_on_one_rank_stops_every_rank(setup):
    dp = _cfg(setup, "nan", steps=1)
    results = run_ranks(2, dp, fault={"kind": "nan", "rank": 1, "step": 1})
    assert [rc for rc, _, _ in results] == [2, 2], [e[-2000:] for _, _, e in results]
    msgs = [_error_line(err) for _, _, err in results]
    assert msgs[0] == msgs[1] and "loss is nan at step 1" in msgs[0], msgs


def test_oom_on_one_rank_stops_every_rank(setup):
    """In rank 1's backward of its top layer (3 layers, sharded weights), in the first of its two
    micro-batches of step 2: it issues the step's remaining gathers (the rest of that backward, all
    of the second pass) and all-reduces as its passes would have (offload.Gather.complete), so rank
    0 reaches the exchange; every rank names the OOM and keeps step 1."""
    dp = _cfg(setup, "oom", grad_accum=2, shard_weights=True, model=str(setup[0] / "model3"))
    results = run_ranks(2, dp, fault={"kind": "oom", "rank": 1, "step": 2}, head_rows=32)  # the head's fills too
    assert [rc for rc, _, _ in results] == [2, 2], [e[-2000:] for _, _, e in results]
    msgs = [_error_line(err) for _, _, err in results]
    assert msgs[0] == msgs[1], msgs
    assert "out of GPU memory" in msgs[0] and "rank 1: CUDA out of memory" in msgs[0], msgs[0]
    assert "saved in" in msgs[0] and "--resume" in msgs[0], msgs[0]
    assert json.loads((Path(dp["out_dir"]) / "checkpoint" / "state.json").read_text())["step"] == 1


def test_train_lora_script_under_torchrun(setup):
    """torchrun itself (its agent, its environment) on tools/train_lora.py's one-file loop, 2 ranks:
    rank 0 prints the steps and writes the adapter. lean-train's main under torchrun's environment
    is the two-rank resume's (two_ranks)."""
    root, _ = setup
    out = root / "tool"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
         "tools/train_lora.py", f"model={root / 'model'}", f"data={root / 'data.jsonl'}", f"out_dir={out}",
         "steps=1", "grad_accum=1", "max_tokens=32", "r=2", "targets=down", "heldout_fraction=0", "device=cpu",
         "dtype=float32"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=DEADLINE)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("step 1/1: loss") == 1  # rank 0 speaks
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_a_first_signal_waits_for_the_exchange_a_second_acts():
    """Several processes (a Dist of world 2 here, no group): the first SIGINT is held on the Dist,
    the second raises at once; outside the block the handler is the one before."""
    from lean.runtime.parallel import deferred_signals

    d = Dist(rank=1, world=2)
    before = signal.getsignal(signal.SIGINT)
    with deferred_signals(d):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs between bytecodes
        assert d.signal == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before


def test_only_a_failed_collective_is_a_lost_rank():
    """Gloo reports a dead peer as a plain RuntimeError: RankLost. An OOM, a CUDA error or a
    TrainError raised inside a collective's block stay what they are."""
    d = Dist(rank=0, world=2, peers=[(socket.gethostname(), os.getpid())] * 2)
    with pytest.raises(RankLost, match=r"rank 0: another rank stopped answering \(.*Connection closed by peer.*\) during x"):
        with d.collective("x"):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
    for e in (torch.cuda.OutOfMemoryError("CUDA out of memory"), torch.AcceleratorError("illegal memory access"),
              T.TrainError("a bad batch")):
        with pytest.raises(type(e)) as got:
            with d.collective("x"):
                raise e
        assert got.value is e


def test_an_agreed_error_names_the_failing_ranks_block():
    """Exchanges nest (dist.Dist.agreed): a rank that failed in its outer block meets the others at
    an inner exchange, and every rank raises the text of the failing rank's block. An inner
    RunStopped goes through the outer block without another exchange. (The gloo exchange is
    replaced by what rank 1 would send.)"""
    from lean.runtime.dist import RunStopped

    d = Dist(rank=0, world=2)
    sent = []
    d.all = lambda obj, what: sent.append(what) or [obj, ([], ("error", "no such file: x.jsonl", "loading"), None)]
    with pytest.raises(RunStopped, match=r"^rank 1: no such file: x.jsonl \(in loading\)$"):
        with d.agreed("loading"):
            d.exchange(what="loading the sharded weights (rank 0's turn)")
    assert len(sent) == 1


def test_close_releases_the_captured_graphs_first():
    """A CUDA graph holding NCCL work keeps the communicator from being destroyed: close() resets every
    graph StepGraph handed it before it destroys the process group, and lets go of them."""
    class Graph:
        reset_calls = 0

        def reset(self):
            self.reset_calls += 1

    d, graphs = Dist(rank=0, world=2), [Graph(), Graph()]
    for g in graphs:
        d.hold_graph(g)
    d.close()
    assert [g.reset_calls for g in graphs] == [1, 1] and d.graphs == []


def test_step_ends_issues_the_rest_unless_a_collective_failed():
    """An error mid-step: the rest of the passes' gathers, then every bucket, then the error. A
    failed collective (RankLost): nothing more is issued (it would wait on a dead peer)."""
    from lean.runtime.dist import step_ends

    calls = []

    class Gather:
        def complete(self, passes, reducer, backward):
            calls.append(("complete", passes, backward))

    class Reducer:
        def finish(self):
            calls.append("finish")

    with step_ends(Reducer(), Gather(), 2):
        pass
    with pytest.raises(ValueError), step_ends(Reducer(), Gather(), 2):
        raise ValueError("a bad batch")
    with pytest.raises(RankLost), step_ends(Reducer(), Gather(), 2):
        raise RankLost("rank 1 exited")
    assert calls == ["finish", ("complete", 2, True), "finish"]


def test_count_tokens_equals_pack():
    """Every document form (ids, (ids, mask), a dict with either key pair): pack's token and target counts."""
    g = np.random.default_rng(int(torch.randint(1 << 30, (1,), generator=fresh_generator("cpu"))))
    docs = [(g.integers(0, 50, n), g.random(n) < 0.6) for n in g.integers(1, 40, 7)] + [list(range(5))]
    docs += [{"ids": list(range(9)), "mask": [i % 2 == 0 for i in range(9)]}, {"input_ids": list(range(4))}]
    b = pack(docs, 500, device="cpu")
    assert count_tokens(docs) == (b.n_tokens, b.n_targets)


def test_gradient_buckets_cover_the_buffer_by_layer():
    """Layer 0 alone (the last the backward finishes), then runs of layers going up, each closed as
    it reaches the bucket size; together one contiguous cover of lora.grads, launched top first."""
    from lean.models.config import config_from_hf
    from lean.models.weights import empty_model
    from lean.runtime.lora import LoRA
    from tests.hf_models import tiny_config

    cfg = config_from_hf(dict(tiny_config("llama").to_dict(), num_hidden_layers=7))
    lora = LoRA.init(empty_model(cfg, torch.float32, "cpu"), r=4, alpha=8)
    per_layer = lora.numel // 7 * 4
    red = GradReducer(lora, Dist(), bucket_bytes=2 * per_layer)
    lows = [low for low, _ in red.buckets]
    assert lows == [5, 3, 1, 0]  # layers 5-6, 3-4, 1-2, then 0 alone
    starts = [(v.data_ptr() - lora.grads.data_ptr()) // 4 for _, v in red.buckets]
    sizes = [v.numel() for _, v in red.buckets]
    assert sum(sizes) == lora.numel
    spans = sorted(zip(starts, sizes))
    assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))


def test_sharded_plan_counts_the_buffers_and_prices_the_gathers():
    """Qwen3-8B's shapes over 4 ranks: two rotating full layers in the peak; with a fast link only
    layer 0's gather shows (every other one hides under a layer's compute), with a slow one the
    gathers cost more and more; the printed plan says so."""
    from lean.models.config import config_from_hf
    from lean.models.presets import PRESETS
    from lean.runtime.plan import DEFAULT_RATES, KEEP, gather_cost, make_plan
    from lean.runtime.plan_bytes import layer_weight_bytes
    from lean.runtime.planner import format_plan

    cfg = config_from_hf(PRESETS["qwen3-8b"])
    layer = layer_weight_bytes(cfg, 0, 2, 4)
    C = cfg.hidden  # q, o; k, v; gate, up, down; the two norms; the QK-norms (4 divides the sum): bf16
    assert layer == 2 * (2 * C * (cfg.q_dim + cfg.kv_dim) + 3 * C * cfg.intermediate + 2 * C + 2 * cfg.head_dim)
    keep = (KEEP,) * cfg.n_layers
    plan = make_plan(cfg, 8192, keep, lora_rank=16, world=4)
    assert plan.memory.gather == 2 * layer and plan.world == 4
    assert make_plan(cfg, 8192, keep, lora_rank=16).memory.gather == 0
    g0 = layer * 3 / 4 / DEFAULT_RATES.link
    assert gather_cost(cfg, keep, 8192, 2, DEFAULT_RATES, 4) == pytest.approx(g0, rel=1e-12)
    slow = [gather_cost(cfg, keep, 8192, 2, DEFAULT_RATES._replace(link=r), 4) for r in (20e9, 5e9, 1e9)]
    assert g0 * 5 < slow[0] < slow[1] < slow[2]
    assert "sharded weights over 4 ranks" in format_plan(plan)


def test_sharded_head_is_priced_over_the_link():
    """The sharded lm_head (shard.ShardHead): its 2n - 2 fills are the N-1 parts of a chunk a rank
    receives at rates.link, not the host link; hidden under the head's GEMMs at NVLink rates, they
    show at a slow link; the printed plan says the head is sharded, not on the host."""
    from lean.models.config import config_from_hf
    from lean.models.presets import PRESETS
    from lean.runtime.head_host import chunk_rows
    from lean.runtime.plan import DEFAULT_RATES, KEEP, head_host_cost, make_plan
    from lean.runtime.planner import format_plan

    cfg = config_from_hf(PRESETS["qwen3-8b"])
    V, C, N = cfg.vocab, cfg.hidden, 8192
    Vc = chunk_rows(V, C, 2)
    n = -(-V // Vc)
    gemm = 2 * N * V * C / DEFAULT_RATES.flops
    assert head_host_cost(cfg, N, 2, DEFAULT_RATES, 4) == pytest.approx(gemm, rel=1e-12)  # hidden
    slow = DEFAULT_RATES._replace(link=5e9, h2d=1e15)
    fills = (2 * n - 2) * Vc * C * 2 * 3 / 4 / 5e9
    assert head_host_cost(cfg, N, 2, slow, 4) == pytest.approx(gemm + fills - 3 * gemm, rel=1e-12)
    assert head_host_cost(cfg, N, 2, slow, 1) == pytest.approx(gemm, rel=1e-12)  # one process: the host link
    plan = make_plan(cfg, N, (KEEP,) * cfg.n_layers, lora_rank=16, world=4, head_host=True, embed_host=True)
    text = format_plan(plan)
    assert "lm_head: sharded over the 4 ranks" in text and "lm_head: pinned host memory" not in text, text


def test_gather_rotates_two_buffers_and_keeps_the_bits(setup):
    """A 3-layer model sharded over a 1-rank group in this process, under a plan that offloads layer
    0 and recomputes layer 1 (the rebuild reads the gathered weights too): the step's gradients
    equal the whole model's bit for bit, and the gathers are the ones the rotation needs: 4 in the
    first step (layers 0, 1, 2 forward; 0 again in backward: 1 and 2 are still held), then 2 a step."""
    import torch.distributed as tdist

    from lean.runtime.loader import load_model
    from lean.runtime.lora import LoRA
    from lean.runtime.plan import KEEP, OFFLOAD, RECOMPUTE, make_plan
    from lean.runtime.shard import shard_model
    from lean.runtime.step import forward_backward

    root, _ = setup
    docs, grads, start = [list(range(3, 20)), list(range(7, 18))], [], None
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    real = tdist.all_gather_into_tensor
    try:
        for sharded in (False, True):
            model = load_model(root / "model3", dtype=torch.float32, device="cpu")
            calls = []
            if sharded:
                model = shard_model(model, Dist(), "cpu")
                tdist.all_gather_into_tensor = lambda out, part, **kw: calls.append(out) or real(out, part, **kw)
            lora = LoRA.init(model, r=4, alpha=8, targets=["down"], dropout=0.1, seed=1)
            if start is None:  # B nonzero: every gradient flows
                start = torch.rand(lora.numel, generator=fresh_generator("cpu")) - 0.5
            lora.params.copy_(start)
            lora.sync_lowp()
            plan = make_plan(model.config, 32, (OFFLOAD, RECOMPUTE, KEEP), lora_rank=4, lora_targets=lora.targets,
                             act_bytes=4)
            per_step = []
            for _ in range(2 if sharded else 1):  # the same step twice (the same dropout seed): the same gradient
                lora.zero_grad()
                forward_backward(model, lora, pack(docs, 32, device="cpu"), plan=plan, seed=5)
                per_step.append(len(calls))
                grads.append(lora.grads.clone())
            if sharded:
                assert per_step == [4, 6], per_step
        assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[2])
    finally:
        tdist.all_gather_into_tensor = real
        tdist.destroy_process_group()
