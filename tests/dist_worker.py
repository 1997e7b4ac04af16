"""One rank of a data-parallel lean-train run, for tests/test_dist.py (not a test module itself).

    python -m tests.dist_worker '<json spec>'     # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set

spec: {"cfg": TrainConfig fields, "fault": {"kind", "rank", "step"} or absent}. A fault is injected
into lean/runtime/train.py's forward_backward on one rank, at one optimizer step (1-based):
    kill   the process SIGKILLs itself there (a rank that dies mid-step)
    nan    that rank's loss sum is NaN and its gradient poisoned
    oom    that rank raises torch.cuda.OutOfMemoryError in its top layer's backward (mid-step: the
           layers below have not issued their buckets and gathers)
    stop   every rank raises KeyboardInterrupt there (Ctrl-C: rank 0 saves the last completed step)
On every rank but 0 the writers of the run folder (checkpoint, adapter, metrics, lock, folder
preparation) raise AssertionError if called: only rank 0 writes. Prints rank 0's result as one JSON line; a TrainError exits 2 after printing "rank R: error: ...",
a KeyboardInterrupt exits 130 (as lean-train does). On a GPU rank 0 adds its peak "peak_bytes".
"""
import json
import os
import signal
import sys


def _inject(T, fault, rank):
    """Wrap T.forward_backward so that the fault fires on its rank at its step (see the docstring)."""
    import torch

    import lean.runtime.step as S

    real, real_bwd, state = T.forward_backward, S.layer_backward, {"hit": False}

    def layer_backward(g, sv, w, ads, ctx, li, cfg):
        if state["hit"] and li == cfg.n_layers - 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real_bwd(g, sv, w, ads, ctx, li, cfg)
    S.layer_backward = layer_backward

    def wrapped(model, lora, batch, **kw):
        # lora.steps counts global micro-batches before this one; its step: 1 + that // per-step count
        step = 1 + (lora.steps // int(os.environ["LEAN_TEST_PER_STEP"]))
        hit = step == fault["step"] and (fault["kind"] == "stop" or rank == fault["rank"])
        if hit and fault["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        state["hit"] = hit and fault["kind"] == "oom"
        if hit and fault["kind"] == "stop":
            raise KeyboardInterrupt
        loss, n = real(model, lora, batch, **kw)
        if hit and fault["kind"] == "nan":
            loss.fill_(float("nan"))
            lora.grads.fill_(float("nan"))
        return loss, n
    T.forward_backward = wrapped


def _forbid_writes(T):
    """A rank other than 0 must never write the run folder: its writers raise here."""
    def forbidden(name):
        def call(*a, **k):
            raise AssertionError(f"rank {os.environ['RANK']} called {name}: only rank 0 writes the run folder")
        return call

    for name in ("save_checkpoint", "Metrics", "prepare_out_dir", "RunLock"):
        setattr(T, name, forbidden(name))
    T.LoRA.save = forbidden("LoRA.save")


def main(spec):
    import lean.runtime.train as T

    rank = int(os.environ.get("RANK", "0"))
    cfg = T.TrainConfig(**spec["cfg"])
    if rank != 0:
        _forbid_writes(T)
    os.environ["LEAN_TEST_PER_STEP"] = str(int(os.environ.get("WORLD_SIZE", "1")) * cfg.grad_accum)
    if spec.get("fault"):
        _inject(T, spec["fault"], rank)
    try:
        result = T.train(cfg)
    except T.TrainError as e:
        print(f"rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt as e:
        print(f"rank {rank}: interrupted: {e}", file=sys.stderr, flush=True)
        return 130
    if rank == 0:
        import torch

        out = {k: v for k, v in result.items() if isinstance(v, (int, float, str, type(None)))}
        if torch.cuda.is_available():
            out["peak_bytes"] = torch.cuda.max_memory_allocated()
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
