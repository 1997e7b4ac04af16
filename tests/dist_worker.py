"""One rank of a data-parallel lean-train run, for tests/test_dist.py (not a test module itself).

    python -m tests.dist_worker '<json spec>'     # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set
    forked(spec, env, out, err)                   # the same in a process forked from a warm server

spec: {"cfg": TrainConfig fields, "fault": {"kind", "rank", "step"} or absent, "cli": true or
absent, "head_rows": the lm_head's chunk rows or absent}: with "cli" the rank runs lean-train's
main on the same settings as flags (cli_argv), else
train() here. A fault is injected into the step's forward_backward (lean/runtime/parallel.py) on
one rank, at one optimizer step (1-based):
    kill    the process notes the time (out_dir.logs/killed_at) and SIGKILLs itself there (a rank
            that dies mid-step)
    nan     that rank's loss sum is NaN and its gradient poisoned
    oom     that rank raises torch.cuda.OutOfMemoryError in its top layer's backward (mid-step: the
            layers below have not issued their buckets and gathers)
    signal  that rank sends itself SIGINT there, before its forward (Ctrl-C reaching one rank mid-step;
            the others get none)
On every rank but 0 the writers of the run folder (checkpoint, adapter, metrics, lock, folder
preparation) raise AssertionError if called: only rank 0 writes. Prints rank 0's result as one JSON
line; a TrainError exits 2 after printing "rank R: error: ...", a KeyboardInterrupt exits 130 after
"rank R: interrupted: ..." (as lean-train does). On a GPU rank 0 adds its peak "peak_bytes".
With "cli", lean-train prints and exits as it does for a user.
forked(): what tests/test_dist.py's run_ranks starts on the CPU, from a forkserver that has imported
torch and lean once (a rank's own `import torch` is ~2.3 CPU-s of its ~5); its environment and
output files are set here first.
"""
import json
import os
import signal
import sys
import time


def _inject(P, fault, rank):
    """Wrap P.forward_backward so that the fault fires on its rank at its step (see the docstring)."""
    import torch

    import lean.runtime.step as S

    real, real_bwd, state = P.forward_backward, S.layer_backward, {"hit": False}

    def layer_backward(g, sv, w, ads, ctx, li, cfg):
        if state["hit"] and li == cfg.n_layers - 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real_bwd(g, sv, w, ads, ctx, li, cfg)
    S.layer_backward = layer_backward

    def wrapped(model, lora, batch, **kw):
        # lora.steps counts global micro-batches before this one; its step: 1 + that // per-step count
        step = 1 + (lora.steps // int(os.environ["LEAN_TEST_PER_STEP"]))
        hit = step == fault["step"] and rank == fault["rank"] and not state.get("fired")
        if hit and fault["kind"] == "kill":
            with open(os.environ["LEAN_TEST_LOGS"] + "/killed_at", "w") as f:
                f.write(repr(time.monotonic()))
            os.kill(os.getpid(), signal.SIGKILL)
        if hit and fault["kind"] == "signal":
            state["fired"] = True  # once: a second SIGINT would act at once
            os.kill(os.getpid(), signal.SIGINT)
        state["hit"] = hit and fault["kind"] == "oom"
        loss, n = real(model, lora, batch, **kw)
        if hit and fault["kind"] == "nan":
            loss.fill_(float("nan"))
            lora.grads.fill_(float("nan"))
        return loss, n
    P.forward_backward = wrapped


def _forbid_writes(T):
    """A rank other than 0 must never write the run folder: its writers raise here."""
    import lean.runtime.parallel as P
    import lean.runtime.train_loop as TL
    from lean.runtime.lora import LoRA

    def forbidden(name):
        def call(*a, **k):
            raise AssertionError(f"rank {os.environ['RANK']} called {name}: only rank 0 writes the run folder")
        return call

    for name in ("save_checkpoint", "Metrics", "prepare_out_dir", "RunLock"):
        setattr(T, name, forbidden(name))
    P.save_checkpoint = TL.save_checkpoint = forbidden("save_checkpoint")
    LoRA.save = forbidden("LoRA.save")


# TrainConfig fields as lean-train's flags (spec "cli"): the ones tests/test_dist.py sets
FLAGS = {"model": "--model", "data": "--data", "out_dir": "--out", "max_tokens": "--max-tokens", "steps": "--steps",
         "grad_accum": "--grad-accum", "lr": "--lr", "warmup_steps": "--warmup", "r": "--lora-r", "alpha": "--alpha",
         "dropout": "--dropout", "seed": "--seed", "eval_every": "--eval-every", "save_every": "--save-every",
         "heldout_fraction": "--heldout", "heldout_tokens": "--heldout-tokens", "sample_tokens": "--sample-tokens",
         "dist_timeout": "--dist-timeout"}
SWITCHES = {"resume": ("--resume", True), "shard_weights": ("--shard-weights", True),
            "tables_on_host": ("--tables-on-host", True),
            "progress": ("--quiet", False), "tensorboard": ("--no-tensorboard", False)}


def cli_argv(cfg) -> list:
    """lean-train's command line for a TrainConfig dict (FLAGS, SWITCHES; targets as a comma list)."""
    argv = []
    for k, v in cfg.items():
        if k == "targets":
            argv += ["--targets", ",".join(v)]
        elif k in SWITCHES:
            flag, when = SWITCHES[k]
            argv += [flag] if bool(v) == when else []
        else:
            argv += [FLAGS[k], str(v)]
    return argv


def main(spec):
    import lean.runtime.parallel as P
    import lean.runtime.train as T

    rank = int(os.environ.get("RANK", "0"))
    if spec.get("head_rows"):  # the lm_head's chunks (head_host.chunk_rows): several of a tiny vocabulary
        import lean.runtime.head_host as H
        H.chunk_rows = lambda V, C, elsize, multiple=1, rows=spec["head_rows"]: -(-min(rows, V) // multiple) * multiple
    cfg = T.TrainConfig(**spec["cfg"])
    if rank != 0:
        _forbid_writes(T)
    os.environ["LEAN_TEST_PER_STEP"] = str(int(os.environ.get("WORLD_SIZE", "1")) * cfg.grad_accum)
    os.environ["LEAN_TEST_LOGS"] = cfg.out_dir + ".logs"
    if spec.get("fault"):
        _inject(P, spec["fault"], rank)
    if spec.get("cli"):  # lean-train's own main: its lines and exit status
        from lean.cli import main as lean_train
        return lean_train(cli_argv(spec["cfg"]))
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


def forked(spec, env, out, err):
    """main(spec) in a process forked from run_ranks' forkserver: env set, stdout and stderr to the
    files out and err, one thread for torch and numpy's BLAS (as OMP_NUM_THREADS=1 gives a fresh
    process); exits with main's status."""
    import torch

    from lean.runtime.interp import one_blas_thread

    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    torch.set_num_threads(1)
    one_blas_thread()
    sys.exit(main(spec))


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
