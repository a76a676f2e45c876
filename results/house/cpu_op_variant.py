# one variant of the compiled CPU decoding step at dd3c024, timed, from that checkout's root:
#   python cpu_op_variant.py VARIANT ROUTER
# op: the C++ op of experts_cpu.cpp; dealt: the same step without it; plain: every slot (CUDA's)
import functools
import os
import statistics
import sys
import time

import torch
sys.path.insert(0, os.getcwd())  # run from a checkout of dd3c024
variant, router = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[:1]
import fast, bench
from model import GPT, GPTConfig
if variant != 'op':
    fast.cpu_kernel = torch.compiler.assume_constant_result(lambda: False)
torch.manual_seed(0)
model = GPT(GPTConfig(router=router, **dict(bench.LARGER, block_size=1024))).eval()
if variant == 'plain':  # every slot, as the CUDA step runs them
    paths = fast.FAST._replace(experts=functools.partial(fast.decode_experts, cpu=False))
    compiled = torch.compile(functools.partial(model.decode_token, fast=paths), fullgraph=True,
                             options=fast.CPU_DECODE_OPTIONS)
    step = lambda idx, cache: compiled(idx, cache)
else:
    step = fast.compiled_decode(model)
prompt = torch.randint(0, 76, (1, 16), generator=torch.Generator().manual_seed(0))
model.generate(prompt, 8, temperature=0, decode=step)
times = []
for _ in range(3):
    t0 = time.perf_counter()
    model.generate(prompt, 256, temperature=0, decode=step)
    times.append(time.perf_counter() - t0)
print(f"{variant} {router} {256 / statistics.median(times):.1f}")
