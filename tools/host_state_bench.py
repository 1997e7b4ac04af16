import time, torch
from lean.kernels.adamw import adamw_update, adamw_step
P = 995_000_000
dev = torch.device("cuda")
def t(fn, n=3):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - a)
    return sorted(ts)[len(ts)//2] * 1e3
hyper = torch.tensor([1e-4, 1.0], device=dev); gn = torch.ones(1, device=dev)
lowp = torch.empty(P, dtype=torch.bfloat16, device=dev)
a = time.perf_counter()
hp = [torch.zeros(P, pin_memory=True) for _ in range(4)]
print(f"pinning 4 x {P*4/1e9:.1f} GB: {time.perf_counter()-a:.1f} s", flush=True)
print(f"update, state on the host (zero-copy): {t(lambda: adamw_update(*hp[:3], gn, hp[3], hyper, max_grad_norm=1.0, params_lowp=lowp)):.1f} ms", flush=True)
g = torch.zeros(P, device=dev)
print(f"update, grads on the GPU, p/m/v host: {t(lambda: adamw_update(*hp[:3], gn, g, hyper, max_grad_norm=1.0, params_lowp=lowp)):.1f} ms", flush=True)
dv = [torch.zeros(P, device=dev) for _ in range(3)]
print(f"update, state on the GPU: {t(lambda: adamw_step(*dv, gn, g, hyper, max_grad_norm=1.0, params_lowp=lowp)):.1f} ms", flush=True)
del dv
x = torch.empty(20_000_000, device=dev)
print(f"D2H 80 MB slot copy: {t(lambda: hp[3][:20_000_000].copy_(x, non_blocking=True)):.2f} ms", flush=True)
