"""The AdamW update's time with the LoRA state on the host (lean/runtime/host_state.py) against the
state on the GPU, at Qwen3-30B-A3B's LoRA size (995M parameters, r=16 on attention and experts),
and one layer's gradient slot copied to the host. GPU only.

    PYTHONPATH=. python3 tools/host_state_bench.py

With the state on the host the update kernel reads p, m, v, g and writes p, m, v over the bus
(28 bytes a parameter); CUDA-synchronised wall times, the median of 3 after one warm-up.
"""
import time

import torch

from lean.kernels.adamw import adamw_step, adamw_update

P = 995_000_000  # Qwen3-30B-A3B's LoRA parameters at r=16 (gate_up at 2r)
SLOT = 20_000_000  # about one of its layers' share


def median_ms(fn, n=3):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e3


def main():
    dev = torch.device("cuda")
    hyper, norm = torch.tensor([1e-4, 1.0], device=dev), torch.ones(1, device=dev)
    lowp = torch.empty(P, dtype=torch.bfloat16, device=dev)
    t0 = time.perf_counter()
    p, m, v, g = (torch.zeros(P, pin_memory=True) for _ in range(4))  # (P,) fp32 host each
    print(f"pinning 4 x {P * 4 / 1e9:.1f} GB: {time.perf_counter() - t0:.1f} s", flush=True)
    kw = dict(max_grad_norm=1.0, params_lowp=lowp)
    print(f"update, state on the host: {median_ms(lambda: adamw_update(p, m, v, norm, g, hyper, **kw)):.1f} ms")
    g_dev = torch.zeros(P, device=dev)
    print(f"update, p/m/v on the host, grads on the GPU: "
          f"{median_ms(lambda: adamw_update(p, m, v, norm, g_dev, hyper, **kw)):.1f} ms")
    state = [torch.zeros(P, device=dev) for _ in range(3)]
    print(f"update, state on the GPU: {median_ms(lambda: adamw_step(*state, norm, g_dev, hyper, **kw)):.1f} ms")
    del state
    x = torch.empty(SLOT, device=dev)
    print(f"D2H {SLOT * 4 / 1e6:.0f} MB slot copy: "
          f"{median_ms(lambda: g[:SLOT].copy_(x, non_blocking=True)):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
