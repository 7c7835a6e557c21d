"""Same-machine dense reference for the grouped-matmul bench: torch.matmul (cuBLAS) at the dense
shapes of the routed-experts mix (GLM-5: hidden 6144, moe_intermediate 2048, M = 131072 rows) and
8192^3, bf16, random data, median of 20 CUDA-event timings after warm-up."""
import torch

M, D, F = 131072, 6144, 2048


def t(a, b, reps=20):
    for _ in range(3):
        torch.matmul(a, b)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.matmul(a, b)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def r(*shape):
    return torch.rand(*shape, device="cuda", dtype=torch.bfloat16) * 2 - 1


print(torch.cuda.get_device_name(), torch.__version__)
a = r(8192, 8192)
ms = t(a, r(8192, 8192))
print(f"8192^3: {ms:.3f} ms {2 * 8192**3 / ms * 1e-9:.1f} TFLOP/s")
del a
total_ms, total_flop = 0.0, 0.0
for name, k, n in (("gate_up", D, 2 * F), ("down", F, D)):
    x, w, dy = r(M, k), r(k, n), r(M, n)
    f = 2.0 * M * k * n
    for prod, (p, q) in (("fwd", (x, w)), ("dgrad", (dy, w.t())), ("wgrad", (x.t(), dy))):
        ms = t(p, q)
        total_ms += ms
        total_flop += f
        print(f"{name:8s} {prod:6s} {ms:8.3f} ms {f / ms * 1e-9:6.1f} TFLOP/s")
    del x, w, dy
print(f"dense mix fwd+bwd (torch.matmul): {total_ms:.2f} ms {total_flop / total_ms * 1e-9:.1f} TFLOP/s")
