"""What a training run shows and records: the progress bar, the metrics file (+ TensorBoard), samples.

    progress = Progress(start_step, total_steps, enabled=True)   # tqdm bar, or plain lines
    metrics = Metrics(out_dir)                                   # metrics.jsonl (+ tb/ when
    metrics.log({"kind": "train", "step": 3, "loss": 2.1, ...})  #   tensorboard is installed)
    text = sample(model, lora, tok, "What is your name?", max_new_tokens=32)

Metrics: one JSON line per record, appended (a resumed run continues the file); every numeric
field of a record also goes to TensorBoard as `<kind>/<field>` at its step, when the `tensorboard`
package is importable (torch.utils.tensorboard's writer, events in out_dir/tb). Samples are greedy
generations through lean's kernels with a KV cache (lean/runtime/generate.py): the prompt is
rendered with the model's chat template when it has one (as a user turn, generation prompt on),
else used as plain text.
Tested: tests/test_train.py (metrics lines, TensorBoard events read back, the samples printed by
the default run).
"""
import importlib.util
import json
import os
from pathlib import Path

from .generate import generate

METRICS = "metrics.jsonl"


class Progress:
    """A progress line per step (or held-out batch): tqdm if importable, else print. leave=False:
    the bar goes when it closes (the held-out evaluation's)."""

    def __init__(self, start, total, enabled, desc="lean-train", leave=True):
        self.bar = None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True, leave=leave)
            except ImportError:
                pass

    def update(self, line):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(line, refresh=False)
            self.bar.update(1)
        else:
            print(line, flush=True)

    def write(self, line):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


class Metrics:
    """metrics.jsonl (always) and a TensorBoard log in out_dir/tb (when tensorboard is installed).

    resume_step: a resumed run's checkpoint step. Records of later steps (a run killed after its
    last checkpoint logged them; the resumed run logs those steps again) are dropped from
    metrics.jsonl (rewritten atomically) and purged from the TensorBoard log."""

    def __init__(self, out_dir, tensorboard=True, resume_step=None):
        out_dir = Path(out_dir)
        path = out_dir / METRICS
        self.kept = []  # (kind, step) of the records a resumed run keeps
        if resume_step is not None and path.exists():
            keep = [x for x in path.read_text().splitlines(keepends=True) if _step_of(x) <= resume_step]
            tmp = path.with_name(f".{METRICS}.tmp")
            tmp.write_text("".join(keep))
            os.replace(tmp, path)
            self.kept = [(r.get("kind"), r.get("step")) for r in map(json.loads, keep)]
        self.fh = open(path, "a")
        self.tb = None
        if tensorboard and importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter
            purge = None if resume_step is None else resume_step + 1
            self.tb = SummaryWriter(log_dir=str(out_dir / "tb"), purge_step=purge)

    def log(self, record):
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        if self.tb is not None:
            kind, step = record.get("kind", "run"), record.get("step", 0)
            for k, v in record.items():
                if k not in ("kind", "step") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(f"{kind}/{k}", v, step)
                elif k == "text":
                    self.tb.add_text(f"{kind}/text", v, step)
            self.tb.flush()

    def close(self):
        self.fh.close()
        if self.tb is not None:
            self.tb.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class NoMetrics:
    """The Metrics of a rank other than 0 in a run of several processes: nothing is written (rank 0
    logs the step's global values)."""
    kept = []

    def log(self, record):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def _generation_eos(model_dir) -> set:
    """generation_config.json's eos_token_id (an id or a list: Llama 3 ends turns with <|eot_id|>,
    which its tokenizer's eos_token is not); empty when the folder has none."""
    try:
        eos = json.loads((Path(model_dir) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, TypeError, AttributeError):
        return set()
    return {i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)}


def _step_of(line) -> float:
    """A metrics line's step; inf for a line a killed run left torn (dropped on resume)."""
    try:
        return json.loads(line).get("step", 0)
    except ValueError:
        return float("inf")


def sample(model, lora, tok, prompt, max_new_tokens=32):
    """Greedy answer to `prompt` (chat-templated when the tokenizer has a template), as text."""
    if tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        ids = tok.encode(text)
    else:
        ids = tok.encode(prompt, add_special_tokens=True)
    stop = {i for i in (tok.eos_id,) if i is not None} | _generation_eos(model.path)
    out = generate(model, lora, ids, max_new_tokens=max_new_tokens, stop_ids=stop)
    return tok.decode(out, skip_special_tokens=True).strip()
