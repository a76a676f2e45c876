"""The default model's training step split in forward + backward and AdamW, topk against its
dense twin (bench.py's models), each AdamW as train.py makes it on a CPU (a loop over the
parameters) and fused, all in turns. Run from the repository root: python results/cpu76/adamw.py
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
import bench  # noqa: E402
import fast  # noqa: E402
from configurator import keep_freed_cpu_memory  # noqa: E402
from router import step_ks  # noqa: E402

keep_freed_cpu_memory()
gen = torch.Generator().manual_seed(0)
x, y = (torch.randint(0, 76, (16, 128), generator=gen) for _ in range(2))
runs = {}
for router in ('dense', 'topk'):
    model = fast.paths(bench.build(router, bench.SIZES['default']).train())
    for fused in (False, True):
        runs[router, fused] = model, torch.optim.AdamW(model.parameters(), 1e-4, fused=fused)
times = {key: ([], []) for key in runs}
for i in range(12):
    for key, (model, opt) in runs.items():
        t0 = time.perf_counter()
        _, ce, aux = model(x, y, moe_ks=step_ks(model.config, len(model.routers())))
        (ce + aux['aux_loss']).backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:  # two warm-ups
            times[key][0].append(t1 - t0)
            times[key][1].append(time.perf_counter() - t1)
print("| model | parameters | AdamW | forward + backward ms | AdamW ms |\n|" + " --- |" * 5)
for (router, fused), (fwd_bwd, adamw) in times.items():
    n = sum(p.numel() for p in runs[router, fused][0].parameters())
    print(f"| {router} | {n / 1e6:.2f}M | {'fused' if fused else 'default (a loop)'} | "
          f"{statistics.median(fwd_bwd) * 1e3:.1f} | {statistics.median(adamw) * 1e3:.1f} |")
