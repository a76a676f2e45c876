"""Where the CPU MoE layer's time over the dense FFN goes: the profiler's self time per op
category, per forward + backward call, at bench.py --what=moe's shape (4096 tokens x 256, 64
experts of 128, top-8). Run from the repository root: python results/cpu76/layer_split.py [topk]"""
import collections
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.getcwd())
import fast  # noqa: E402
from configurator import keep_freed_cpu_memory  # noqa: E402
from model import GPTConfig, MoE  # noqa: E402

keep_freed_cpu_memory()  # as bench.py
C, H, N, k, M, calls = 256, 128, 64, 8, 4096, 8
torch.manual_seed(0)
x = torch.randn(1, M, C, requires_grad=True)
dense = torch.nn.Sequential(torch.nn.Linear(C, k * H, bias=False), torch.nn.GELU(),
                            torch.nn.Linear(k * H, C, bias=False))
router = sys.argv[1] if len(sys.argv) > 1 else 'topk'
moe = MoE(GPTConfig(n_embd=C, n_exp=N, top_k=k, exp_dim=H, router=router))
torch.nn.init.normal_(moe.w_fc, std=0.02)
torch.nn.init.normal_(moe.w_proj, std=0.02)
moe = fast.paths(moe)
layers = dict(dense=lambda: dense(x), moe=lambda: moe(x)[0])
CATEGORY = {'aten::mm': 'matmul (the router\'s linear too)', 'aten::index_select': 'gather',
            'aten::scatter_add_': 'scatter-add', 'aten::gelu': 'gelu',
            'aten::gelu_backward': 'gelu', 'aten::topk': 'router', 'aten::_softmax': 'router',
            'aten::nonzero_static': 'pairs', 'aten::mul': 'multiply'}
per_call = {}
for name, layer in layers.items():
    layer().float().square().mean().backward()  # a warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            layer().float().square().mean().backward()
    per_call[name] = collections.Counter()
    for event in prof.key_averages():
        per_call[name][CATEGORY.get(event.key, 'other')] += event.self_cpu_time_total / calls / 1e3
dense_ms, moe_ms = (sum(per_call[n].values()) for n in ('dense', 'moe'))
print(f"| op | dense FFN ms | MoE {router} ms | MoE - dense, in dense FFNs |\n|" + " --- |" * 4)
for cat in sorted(per_call['moe'] | per_call['dense'], key=lambda c: -per_call['moe'][c]):
    d, m = per_call['dense'][cat], per_call['moe'][cat]
    print(f"| {cat} | {d:.1f} | {m:.1f} | {(m - d) / dense_ms:+.3f} |")
print(f"| all | {dense_ms:.1f} | {moe_ms:.1f} | {moe_ms / dense_ms - 1:+.3f} |")
