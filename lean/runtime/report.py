"""A CPU run's report beside its training: the untrained model's held-out loss and sample, and
the trained adapter's sample, in a second process on a second core.

    job = ReportJob.start(spec)          # spawned; None where it does not pay (report_in_process)
    ... train step 1 (the parent) ...
    got = job.result()                   # {"eval": (loss, targets) or None, "sample": text or None}
    job = ReportJob.start(spec, wait=True)   # the adapter's sample: loads the model now (beside the
    ... the last step, the adapter saved ...  #   last step), reads the adapter at go()
    job.go(); got = job.result()

Without a GPU the kernels run in Triton's interpreter: single-threaded Python, one core. The report
before training (a held-out evaluation and a greedy sample, ~2 minutes for SmolLM2-135M on a slow
2-core machine) needs only the untrained model, whose LoRA B is zero: a second process loads the
model and computes it while the first trains step 1. The second process of the adapter's sample
starts beside the last step and loads the model there (SmolLM2: ~6 s off the run's end); once the
adapter is saved it reads it and samples while the first evaluates. Both use the same kernels on the same
inputs with one BLAS thread each (interp.py), so the numbers equal the in-process ones bit for bit.
The child ignores Ctrl-C (the parent handles it and ends the child) and reports an error as text
(TrainError in the parent). spec: model_dir, dtype, lora (LoRA.init keywords) or adapter (a
folder), heldout (documents) and budget (tokens per batch), prompt and tokens.
Tested: tests/test_cli_guard.py (the report of a run with the second process equals the in-process one).
"""
import multiprocessing
import os
import signal

from .checkpoint import TrainError

MIN_PARAMS = 2**25  # a model of 32M+ parameters: its report outlasts the second process's start (~3-8 s)


def report_in_process(cfg, device, model) -> bool:
    """True where the report runs beside the training: cfg.report_process, or with None (lean-train's
    setting) on the CPU with 2+ cores and a model of MIN_PARAMS+ parameters (the tests' tiny
    models stay in process). Off by default in TrainConfig: a spawned process imports the caller's
    __main__, which a script must guard (if __name__ == "__main__")."""
    if cfg.report_process is not None:
        return bool(cfg.report_process)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    params = model.embed.numel() + sum(w.buf.numel() + 2 * w.qbuf.numel() for w in model.layers)
    return device == "cpu" and cores >= 2 and params >= MIN_PARAMS


class ReportJob:
    """A spawned process computing one report (see the module docstring)."""

    def __init__(self, process, conn):
        self.process, self.conn, self.got, self.go_conn = process, conn, None, None

    @classmethod
    def start(cls, spec: dict, wait: bool = False) -> "ReportJob":
        """wait: the process loads the model, then waits for go() before it reads spec's adapter (started
        beside the last training step, so that its start-up and model load are not on the run's end)."""
        ctx = multiprocessing.get_context("spawn")  # not fork: torch's thread pools do not survive it
        parent, child = ctx.Pipe(duplex=False)
        go_recv, go_send = ctx.Pipe(duplex=False) if wait else (None, None)
        process = ctx.Process(target=_child, args=(child, spec, go_recv), name="lean-train-report", daemon=True)
        process.start()
        child.close()
        job = cls(process, parent)
        job.go_conn = go_send
        return job

    def go(self):
        """A waiting job (start(wait=True)): its adapter is written; compute now."""
        if self.go_conn is not None:
            try:
                self.go_conn.send(True)
            except OSError:  # the process is gone: result() reports it
                pass

    def result(self) -> dict:
        """The report, waiting for it; TrainError if the process failed."""
        if self.got is None:
            try:
                status, payload = self.conn.recv()
            except EOFError:
                status, payload = "error", f"it ended with exit status {self.process.exitcode}"
            self.close()
            if status != "ok":
                raise TrainError(f"the report process (held-out loss and sample beside the training) failed: "
                                 f"{payload}; pass report_process=False to compute them in this process")
            self.got = payload
        return self.got

    def close(self):
        """End the process (done, or no longer wanted: an error or Ctrl-C in the parent)."""
        if self.process.is_alive():
            self.process.terminate()
        self.process.join()
        self.conn.close()
        if self.go_conn is not None:
            self.go_conn.close()


def _child(conn, spec, go=None):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; it ends this process
    try:
        result = ("ok", _compute(spec, go))
    except BaseException as e:  # noqa: BLE001  (sent to the parent, which raises it)
        result = ("error", f"{type(e).__name__}: {e}")
    try:
        conn.send(result)
    except OSError:  # the parent is gone (killed): nobody to tell
        pass


def _compute(spec, go=None) -> dict:
    import torch

    from .batch import pack
    from .data import pack_batches
    from .interp import one_blas_thread
    from .loader import load_model
    from .lora import LoRA
    from .observe import sample
    from .tokenizer import Tokenizer
    from .train_loop import evaluate

    one_blas_thread()
    model = load_model(spec["model_dir"], dtype=getattr(torch, spec["dtype"]), device="cpu", quant=spec.get("quant"))
    if go is not None:  # started beside the last step: the adapter exists once the parent says so
        go.recv()
    lora = LoRA.load(model, spec["adapter"]) if spec.get("adapter") else LoRA.init(model, **spec["lora"])
    got = {"eval": None, "sample": None}
    if spec.get("heldout"):
        budget, vocab = spec["budget"], model.config.vocab
        batches = [pack(b, budget, device="cpu", vocab=vocab) for b in pack_batches(spec["heldout"], budget, shuffle=False)]
        got["eval"] = evaluate(model, lora, batches)
    if spec.get("tokens"):
        got["sample"] = sample(model, lora, Tokenizer.from_dir(spec["model_dir"]), spec["prompt"],
                               max_new_tokens=spec["tokens"])
    return got
