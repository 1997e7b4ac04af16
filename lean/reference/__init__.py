"""The yardstick: plain-torch references for every kernel, the HF + PEFT oracle for a whole LoRA
step, and the project's tolerance rule. One module per op family, mirroring lean/kernels/.

    from lean.reference.rmsnorm import rmsnorm_ref          # a reference
    from lean.reference.rule import close_rule              # the tolerance rule: a Verdict
    from lean.reference.hf_peft import hf_loss_and_grads    # the step, as transformers + PEFT run it

Why torch does math here: lean's rule is that torch holds tensors and never computes inside the
step (tests/test_step_gpu.py records every aten op a step dispatches). A reference is the opposite
of the step: it is what the step is measured against, so it must be the plain, obvious torch
recipe (HF's cast order, autograd for the backward), never lean's own code. The tests, the
benchmarks (tools/) and `lean-check` (lean/check/) import it; nothing the step runs does
(tests/test_check.py asserts that importing lean, building a model and running a step loads no
lean.reference module). It lives in the package, not in tests/, so that `lean-check` can compare
every kernel on a user's GPU without the test suite.

Backward references come from torch.autograd on the reference forward. Each function computes in
the dtype it is given: upcast the inputs (float64, or float32 on a GPU) for the high-precision
reference, pass the kernel's own 16-bit inputs for torch's own low-precision result (the rule's
`lowp`).
"""
