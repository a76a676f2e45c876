"""
Benchmarks, measured side by side in one run and printed as Markdown tables.

    python bench.py                  # everything below, on CPU
    python bench.py --what=route     # the routing alone: each router's selection, per call
    python bench.py --what=train     # training step time per router, default and larger model
    python bench.py --what=train --sizes=gpu --routers=dense,topk,seqtopk --ways=eager,compiled
    python bench.py --what=moe       # the MoE layer alone vs a dense FFN of its active params
    python bench.py --what=decode    # long context: caches vs recompute, eager vs compiled
    python bench.py --device=cuda --dtype=bfloat16 --compile=True --out_dir=results/gpu

Models are randomly initialised. Each time is the median of `repeats` rounds after a warm-up, the
variants taking turns in each round; each ratio is the median of the per-round ratios, with their
middle half. Targets, CPU: seqtopk / topk step <= 1.03; MoE / dense FFN <= 1.5 (64 experts, top-8);
compiled decoding >= 2x eager (topk), compiled seqtopk >= 0.97x topk; caches >= 10x recompute at
contexts >= 512. GPU (bf16), the gpu size: compiled MoE step <= 1.3x its dense twin, MoE layer wall
<= 1.5x the dense FFN in at most 40 kernels (forward + backward, compiled), compiled decoding
seqtopk / topk >= 0.95.
"""
import json
import os
import runpy
import statistics
import sys
import time
import warnings
from dataclasses import replace

import torch
import torch._inductor.config  # bench_decode times the first compile with its caches off
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import fast
from cache import Cache
from configurator import (Rule, a_seed, autocast_for, configure, each, fail,
                          keep_freed_cpu_memory, one_of, positive_int)
from model import GPT, GPTConfig, MoE
from router import ROUTERS, batchtopk_mask, seqtopk_mask, step_ks, topk_mask
from sample import StaticCache, compiled_decode, generate

# -----------------------------------------------------------------------------
what = 'all'              # all | route | train | moe | decode
device = 'cpu'            # cpu, cuda or cuda:N
dtype = 'float32'         # float32 | bfloat16 (autocast; the router stays fp32)
compile = False           # torch.compile the model (train) and the layers (moe)
ways = ''                 # train and moe: eager, compiled or both ('': --compile's); on a GPU a
#                           compiled step with static shapes runs as CUDA graphs
repeats = 5               # each figure is the median of this many timed runs
seed = 0
out_dir = ''              # also write the results there, as bench.json
# train: models named in `sizes`, each router, one batch of 16 sequences
sizes = 'default,larger'  # default (train.py's model), larger, tiny (config/tiny.py's), gpu
routers = ','.join(ROUTERS)  # timed in training, topk among them; dense: the dense twin
train_steps = 10          # optimizer steps per timed run
# moe: one layer, tokens x n_embd, against a dense FFN of width top_k * exp_dim
moe_tokens = 4096
moe_embd = 256
moe_exp_dim = 128
moe_n_exp = 64
moe_top_k = 8
moe_repeats = 21          # the layers take about a second a round: more rounds settle their ratios
# decode: the larger model with a 1024-token context (character vocabulary), or another size's
decode_size = 'larger'
decode_block_size = 1024
new_tokens = 512          # tokens generated for the cached-vs-recompute comparison
prompt_tokens = 16
contexts = '64,512,960'   # contexts at which per-step decode speed is measured
steps_at_context = 64     # decode steps timed at each context
decode_ways = 'eager,compiled'  # the decoding step eager, compiled (once, then a graph a step)
# -----------------------------------------------------------------------------
# the models: train.py's default (on the built-in data's 76 characters), larger, config/tiny.py's,
# and what a GPU user trains (GPT-2's vocabulary; with its MoE table: --moe_tokens=8192
# --moe_embd=512 --moe_exp_dim=2048 --moe_n_exp=8 --moe_top_k=2)
SIZES = dict(default=dict(vocab_size=76),
             larger=dict(n_layer=6, n_head=8, n_embd=256, n_exp=16, top_k=4, exp_dim=256,
                         block_size=256, vocab_size=76),
             tiny={k: v for k, v in runpy.run_path(os.path.join(os.path.dirname(
                 os.path.abspath(__file__)), 'config', 'tiny.py')).items()
                   if k in GPTConfig.__dataclass_fields__} | dict(vocab_size=76),
             gpu=dict(n_layer=6, n_head=8, n_embd=512, block_size=512, n_exp=8, exp_dim=2048,
                      top_k=2, vocab_size=50257))
RULES = dict(what=one_of('all', 'route', 'train', 'moe', 'decode'),
             ways=Rule(lambda v: v == '' or each(one_of('eager', 'compiled')).test(v),
                       "'', eager, compiled or eager,compiled"),
             device=Rule(lambda v: v == 'cpu' or v.split(':')[0] == 'cuda', 'cpu, cuda or cuda:N'),
             dtype=one_of('float32', 'bfloat16'), repeats=positive_int, seed=a_seed,
             sizes=each(one_of(*SIZES)), train_steps=positive_int,
             routers=each(one_of(*ROUTERS, 'dense')), moe_tokens=positive_int,
             moe_embd=positive_int, moe_exp_dim=positive_int, moe_n_exp=positive_int,
             moe_top_k=positive_int, moe_repeats=positive_int, decode_size=one_of(*SIZES),
             decode_block_size=positive_int, new_tokens=positive_int, prompt_tokens=positive_int,
             contexts=each(positive_int, int), steps_at_context=positive_int,
             decode_ways=each(one_of('eager', 'compiled')))
RELATIONS = [('routers', lambda c: 'topk' in c['routers'].split(','), 'a list with topk in it'),
             ('moe_top_k', lambda c: c['moe_top_k'] <= c['moe_n_exp'],
              'at most --moe_n_exp={moe_n_exp}'),
             ('new_tokens', lambda c: c['prompt_tokens'] + c['new_tokens']
              <= c['decode_block_size'], 'at most --decode_block_size={decode_block_size} minus '
              '--prompt_tokens={prompt_tokens}'),
             ('contexts', lambda c: max(int(x) for x in c['contexts'].split(','))
              + c['steps_at_context'] <= c['decode_block_size'],
              'contexts of at most --decode_block_size={decode_block_size} minus '
              '--steps_at_context={steps_at_context}')]
# dense peak TFLOP/s per GPU and dtype (vendors' datasheets), for MFU; another GPU: no MFU
PEAK_TFLOPS = {('H100 PCIe', 'bfloat16'): 756, ('H100', 'bfloat16'): 989, ('H200', 'bfloat16'): 989,
               ('A100', 'bfloat16'): 312, ('L4', 'bfloat16'): 121, ('H100', 'float32'): 67,
               ('H200', 'float32'): 67, ('A100', 'float32'): 19.5}
CAPPED = 'compiled, experts capped at top_k'  # see bench_decode
warnings.filterwarnings('ignore', message='dynamo_pgo force disabled')  # cold compiles: as meant
device_type = device.split(':')[0]


def autocast():  # --dtype's autocast, off for float32 (as train.py and sample.py)
    return autocast_for(device, dtype)[1]


def timed(fn):
    """fn()'s seconds and result, a GPU's queued work waited for before and after."""
    sync = torch.cuda.synchronize if device_type == 'cuda' else lambda: None
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def in_turns(fns, rounds=None):
    """{name: its seconds in each of `rounds` (default `repeats`) rounds} after a warm-up, the fns
    taking turns in each."""
    times = {name: [] for name in fns}
    for round in range(-1, rounds or repeats):
        for name, fn in fns.items():
            seconds, _ = timed(fn)
            if round >= 0:  # round -1 warms up
                times[name].append(seconds)
    return times


def ratio(times, name, base):
    """The median of name's time / base's in each round, and their middle half."""
    ratios = [a / b for a, b in zip(times[name], times[base])]
    low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return statistics.median(ratios), f"{low:.2f}-{high:.2f}"


def compare(fns, base, rounds=None):
    """{name: (median seconds, median of its time / base's in each round, their middle half)}."""
    times = in_turns(fns, rounds)
    return {name: (statistics.median(t), *ratio(times, name, base)) for name, t in times.items()}


def kernel_work(events):
    """The CUDA kernels' busy time (µs: the union of their intervals, overlaps once) and count,
    from profiler events (name, start µs, duration µs, kind): memcpy and memset apart."""
    spans = sorted((s, s + d) for name, s, d, kind in events if kind == 'kernel' or kind is None
                   and not name.startswith(('Memcpy', 'Memset')))  # None: by the name
    busy, end = 0.0, float('-inf')
    for start, stop in spans:  # in start order: the part past the union so far is new
        busy, end = busy + max(0.0, stop - max(start, end)), max(end, stop)
    return busy, len(spans)


def device_work(run, calls):
    """The GPU's busy time (s) and the kernels it ran, per call, over one run() of `calls` calls
    (kernel_work: CUDA graphs save their launches, not their kernels); on the CPU, None, None."""
    if device_type != 'cuda':
        return None, None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    busy, kernels = kernel_work((e.name, e.time_range.start, e.time_range.elapsed_us(),
                                 getattr(e, 'activity_type', None))  # None: an older torch
                                for e in prof.events() if e.device_type == DeviceType.CUDA)
    return busy / 1e6 / calls, kernels / calls


def way_list():
    return ways.split(',') if ways else ['compiled' if compile else 'eager']


def table(title, header):
    """A section's title and its Markdown table's header, columns split by ' | '."""
    print(f"\n### {title}\n\n| {header} |\n|" + " --- |" * (header.count(' | ') + 1))


def build(router, shape):
    """The model of `shape` with this router; 'dense': its dense twin, every block a dense FFN of
    the MoE layer's active width (top_k x exp_dim: the same active FLOPs)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(**shape)
    cfg = replace(cfg, router=router) if router != 'dense' else replace(
        cfg, moe_every=0, mlp_dim=cfg.top_k * cfg.exp_dim)
    return GPT(cfg).to(device)


def bench_route(results):
    """The selection alone, scores -> mask, for one batch of 16x128 tokens (no expert runs)."""
    table("Routing: scores (16 x 128 tokens x N experts) -> mask, one call",
          "experts | router (path) | µs / call | vs topk")
    for n_exp, k in ((8, 2), (64, 8)):
        logits = torch.randn(16, 128, n_exp, generator=torch.Generator().manual_seed(seed))
        logits = logits.to(device)
        scores = logits.softmax(-1)
        paths = {'topk': lambda: topk_mask(scores, k),
                 'seqtopk (training: offline)': lambda: seqtopk_mask(scores, k),
                 'seqtopk (causal evaluation: online)':
                     lambda: fast.online_seqtopk_counted(scores, k, 1, k + 2),
                 'batchtopk (training)': lambda: batchtopk_mask(scores, k),
                 'batchtopk (evaluation: threshold)': lambda: scores > 1 / n_exp,
                 'relu': lambda: F.relu(logits) > 0}
        with torch.no_grad():
            timing = compare({name: (lambda fn: lambda: [fn() for _ in range(20)])(fn)
                              for name, fn in paths.items()}, 'topk')
        for name, (seconds, ratio, _) in timing.items():
            us = seconds / 20 * 1e6
            results['route'].append(dict(n_exp=n_exp, top_k=k, path=name, us_per_call=us,
                                         ratio_vs_topk=ratio))
            print(f"| {n_exp}, top-{k} | {name} | {us:.0f} | {ratio:.2f} |")


def bench_train(results, gpu):
    """Training step time (forward + backward + AdamW) per router and way, for each model in
    `sizes`, against topk's and the dense twin's in the same way; on a GPU its busy time."""
    table(f"Training step (forward + backward + AdamW), {train_steps} steps per run",
          "model | batch | router | way | ms / step | vs topk (middle half of rounds) | vs dense "
          "twin | peak memory | MFU (active params) | GPU busy ms / step | kernels / step")
    peak = next((tflops * 1e12 for (name, kind), tflops in PEAK_TFLOPS.items()
                 if name in gpu and kind == dtype), None)  # the GPU's, in this dtype
    batch = 16
    for size in sizes.split(','):
        shape = SIZES[size]
        T = GPTConfig(**shape).block_size
        gen = torch.Generator().manual_seed(seed)
        x, y = (torch.randint(0, shape['vocab_size'], (batch, T), generator=gen).to(device)
                for _ in range(2))
        runs, models = {}, {}
        for router in routers.split(','):
            for way in way_list():
                models[router, way] = model = fast.paths(build(router, shape).train())
                # compiled as train.py compiles it: CUDA graphs where its step allows them
                graphs = fast.graph_step(model, device_type)
                step_model = (torch.compile(model, mode='reduce-overhead' if graphs else None)
                              if way == 'compiled' else model)
                opt = model.configure_optimizers(0.1, 1e-4, (0.9, 0.99), device_type)

                def run(step_model=step_model, opt=opt, cfg=model.config,
                        n_moe=len(model.routers())):
                    for _ in range(train_steps):
                        moe_ks = step_ks(cfg, n_moe)  # drawn outside the model, as train.py does
                        with autocast():
                            _, ce, aux = step_model(x, y, moe_ks=moe_ks)
                        (ce + aux['aux_loss']).backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                runs[router, way] = run
        times = in_turns(runs)
        for (router, way), model in models.items():
            seconds = statistics.median(times[router, way]) / train_steps
            vs_topk, spread = ratio(times, (router, way), ('topk', way))
            vs_dense = ratio(times, (router, way), ('dense', way))[0] if (
                'dense', way) in times else None
            memory, mfu = None, None
            if device_type == 'cuda':  # the peak allocated (torch tracks none on CPU)
                torch.cuda.reset_peak_memory_stats()
                runs[router, way]()
                memory = torch.cuda.max_memory_allocated()
            if peak:  # 6 flops per active parameter per token, plus attention (nanoGPT's estimate)
                cfg = model.config
                flops = 6 * model.num_params(active=True) + 12 * cfg.n_layer * cfg.n_embd * T
                mfu = flops * batch * T / seconds / peak
            busy, kernels = device_work(runs[router, way], train_steps)
            results['train'].append(dict(
                model=size, batch=batch, router=router, way=way, ms_per_step=seconds * 1e3,
                ratio_vs_topk=vs_topk, ratio_middle_half=spread, ratio_vs_dense=vs_dense,
                peak_memory_bytes=memory, mfu=mfu, gpu_busy_ms_per_step=busy and busy * 1e3,
                kernels_per_step=kernels))
            print(f"| {size} ({model.num_params() / 1e6:.1f}M, "
                  f"{model.num_params(active=True) / 1e6:.1f}M active) | {batch}x{T} | {router} | "
                  f"{way} | {seconds * 1e3:.1f} | {vs_topk:.3f} ({spread}) | "
                  f"{'n/a' if vs_dense is None else f'{vs_dense:.3f}'} | "
                  f"{'n/a' if memory is None else f'{memory / 2**20:.0f} MiB'} | "
                  f"{'n/a' if mfu is None else f'{mfu:.1%}'} | "
                  f"{'n/a' if busy is None else f'{busy * 1e3:.2f}'} | "
                  f"{'n/a' if kernels is None else f'{kernels:.0f}'} |")


def bench_moe(results):
    """The MoE layer (router + dispatch + experts) against a dense FFN of its active params."""
    C, H, N, k = moe_embd, moe_exp_dim, moe_n_exp, moe_top_k
    table(f"MoE layer vs dense FFN: {moe_tokens} tokens x {C}, {N} experts of width {H}, top-{k} "
          f"(dense FFN width {k * H}), forward + backward", "layer | way | ms | vs dense (middle "
          "half of rounds) | GPU busy ms | kernels")
    torch.manual_seed(seed)
    x = torch.randn(1, moe_tokens, C, device=device, requires_grad=True)
    dense = torch.nn.Sequential(torch.nn.Linear(C, k * H, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(k * H, C, bias=False)).to(device)
    layers = {'dense FFN': dense}
    for router in ('topk', 'seqtopk'):
        torch.manual_seed(seed)
        moe = MoE(GPTConfig(n_embd=C, n_exp=N, top_k=k, exp_dim=H, router=router)).to(device)
        torch.nn.init.normal_(moe.w_fc, std=0.02)
        torch.nn.init.normal_(moe.w_proj, std=0.02)
        for impl in ('grouped', 'loop'):
            layers[f'MoE {router}, {impl}'] = fast.paths(moe, impl)
        if router == 'topk':  # the plain model's experts, for contrast
            layers['MoE topk, textbook loop'] = moe
    runs = {}
    for name, layer in layers.items():
        for way in way_list():
            if way == 'compiled' and name.endswith('loop'):  # host reads per expert: eager only
                continue
            fn = torch.compile(layer) if way == 'compiled' else layer

            def run(fn=fn, dense=layer is dense):
                with autocast():
                    out = fn(x) if dense else fn(x)[0]
                out.float().square().mean().backward()
            runs[name, way] = run
    times = in_turns(runs, moe_repeats)
    for name, way in runs:
        ms = statistics.median(times[name, way]) * 1e3
        vs_dense, spread = ratio(times, (name, way), ('dense FFN', way))
        busy, kernels = device_work(runs[name, way], 1)
        results['moe'].append(dict(layer=name, way=way, ms=ms, ratio_vs_dense=vs_dense,
                                   ratio_middle_half=spread, gpu_busy_ms=busy and busy * 1e3,
                                   kernels=kernels))
        print(f"| {name} | {way} | {ms:.2f} | {vs_dense:.2f} ({spread}) | "
              f"{'n/a' if busy is None else f'{busy * 1e3:.3f}'} | "
              f"{'n/a' if kernels is None else f'{kernels:.0f}'} |")


@torch.inference_mode()
def decode_in_turns(ways, prompt, steps, recompute_every=1, block=16, recompute=()):
    """Greedy decoding after `prompt` in each way, name -> (model, step, cache), as generate(), the
    ways taking turns every `block` steps; those in `recompute` also recompute the context every
    `recompute_every`-th step. Per way: the seconds of each step (0: the prompt) and recompute, and
    the tokens."""
    idx, last = dict.fromkeys(ways, prompt), {}
    cached, recomputed = {name: [] for name in ways}, {name: [] for name in ways}
    for _, _, cache in ways.values():
        cache.reset()
    with autocast():  # --dtype=bfloat16: one bf16 region over the whole generation, as sample.py's
        for first in range(0, steps, block):
            turn = range(first, min(steps, first + block))
            for name, (model, step, cache) in ways.items():
                for i in turn:
                    seconds, out = timed(lambda: step(idx[name] if i == 0 else last[name], cache))
                    cached[name].append(seconds)
                    last[name] = out[0][:, -1].argmax(-1, keepdim=True)
                    idx[name] = torch.cat([idx[name], last[name]], dim=1)
            for name, (model, _, _) in ways.items():
                for i in (i for i in turn if i % recompute_every == 0 and name in recompute):
                    seconds, _ = timed(lambda: model(idx[name][:, :prompt.shape[1] + i],
                                                     online=True))  # generate's recompute
                    recomputed[name].append(seconds)
    return cached, recomputed, idx


def progress(text):  # where a long decoding table's time goes, beside the table (stderr)
    print(f"bench decode: {text}", file=sys.stderr, flush=True)


def speed_ratio(runs, name, base, skip=0):  # name's cached speed over base's: all, each round
    total = {n: sum(sum(cached[n][skip:]) for cached, *_ in runs) for n in (name, base)}
    rounds = [sum(cached[base][skip:]) / sum(cached[name][skip:]) for cached, *_ in runs]
    return total[base] / total[name], f"{min(rounds):.2f}-{max(rounds):.2f}"


def bench_decode(results):
    """Long-context generation: the caches vs recomputing, seqtopk vs topk, the decoding step eager
    and compiled (seqtopk also capped at top_k experts: what its routing and Expert Cache cost),
    all taking turns; then one step at each of `contexts`."""
    shape = dict(SIZES[decode_size], block_size=decode_block_size)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, shape['vocab_size'], (1, prompt_tokens), generator=gen).to(device)
    models = {router: build(router, shape).eval() for router in ('topk', 'seqtopk')}
    way_names = decode_ways.split(',')
    ways = {(router, way): (model, compiled_decode(model), StaticCache(model.config))
            if way == 'compiled' else (model, model.decode_token, Cache(model.config))
            for router, model in models.items() for way in way_names}
    if 'compiled' in way_names:  # seqtopk's routing and Expert Cache, topk's expert work
        capped = build('seqtopk', shape).eval()
        ways[('seqtopk', CAPPED)] = (capped, compiled_decode(capped, slots=capped.config.top_k),
                                     StaticCache(capped.config))
    # the first generation compiles the step, timed cold (no inductor caches); its tokens checked
    compile_s = {}
    for name, (model, step, cache) in ways.items():
        with autocast(), torch._inductor.config.patch(force_disable_caches=True):
            seconds, generated = timed(lambda: generate(model, prompt, 16, temperature=0,
                                                        decode=step, cache=cache))
        if name[1] != 'eager':
            compile_s[name] = seconds
        progress(f"{name[0]}, {name[1]}: the first 16 tokens in {seconds:.1f} s"
                 + " (the compile included)" * (name[1] != 'eager'))
        if not torch.equal(decode_in_turns({name: ways[name]}, prompt, 16)[2][name], generated):
            fail(f"bench's decoding loop and generate() disagree for {name[0]}, {name[1]}")
    decode_in_turns(ways, prompt, 16)  # a warm-up of the turns themselves

    compiled = (f"; compiled: the decoding step compiled once, cold, in "
                f"{compile_s[('topk', 'compiled')]:.0f} s for topk and "
                f"{compile_s[('seqtopk', 'compiled')]:.0f} s for seqtopk" if compile_s else '')
    table(f"Decoding: {new_tokens} new tokens after a {prompt_tokens}-token prompt, {decode_size} "
          f"model with a {decode_block_size}-token context (greedy, batch 1; the ways in turns"
          f"{compiled})", "router | decoding step | KV + Expert Cache tok/s | full recompute tok/s "
          "(eager) | speed-up")
    recompute = {(router, way_names[0]) for router in models}  # the model's own forward: eager
    runs, rounds = [], min(repeats, 3)  # a minute a round on CPU
    for i in range(rounds):
        t0 = time.perf_counter()
        runs.append(decode_in_turns(ways, prompt, new_tokens, recompute=recompute))
        progress(f"round {i + 1} of {rounds}: {time.perf_counter() - t0:.1f} s")
    for router, way in ways:
        cached = sum(sum(c[(router, way)]) for c, *_ in runs) / len(runs)
        recomputed = sum(sum(r[(router, way_names[0])]) for _, r, *_ in runs) / len(runs)
        results['decode'].append(dict(
            router=router, way=way, new_tokens=new_tokens, block_size=decode_block_size,
            cached_tok_s=new_tokens / cached, recompute_tok_s=new_tokens / recomputed,
            compile_s=compile_s.get((router, way))))
        print(f"| {router} | {way} | {new_tokens / cached:.1f} | {new_tokens / recomputed:.1f} "
              f"| {recomputed / cached:.1f}x |")
    print()
    for name, base, label in (
            (('seqtopk', 'eager'), ('topk', 'eager'), 'seqtopk / topk, eager'),
            (('seqtopk', 'compiled'), ('topk', 'compiled'), 'seqtopk / topk, compiled'),
            (('topk', 'compiled'), ('topk', 'eager'), 'compiled / eager, topk'),
            (('seqtopk', 'compiled'), ('seqtopk', 'eager'), 'compiled / eager, seqtopk'),
            (('seqtopk', CAPPED), ('topk', 'compiled'), f'seqtopk {CAPPED} / topk, compiled')):
        if name in ways and base in ways:
            ratio, spread = speed_ratio(runs, name, base)
            results['decode_ratios'].append(dict(ratio=label, value=ratio, rounds=spread))
            print(f"{label} cached decode speed: {ratio:.3f} (rounds: {spread})")
    table(f"One decode step at a given context ({steps_at_context} cached steps and "
          f"{steps_at_context // 8 + 1} full recomputes, one every 8 steps, in each of {repeats} "
          f"rounds)", "context | decoding step | topk cached ms | seqtopk cached ms | seqtopk / "
          "topk speed (rounds) | topk recompute ms | seqtopk recompute ms | cache speed-up (topk, "
          "seqtopk) | KV cache | Expert Cache")
    ways = {name: ways[name] for name in ways if name[1] in way_names}
    cache = ways[('seqtopk', way_names[-1])][2]  # compiled: both caches in block_size buffers
    for context in (int(c) for c in contexts.split(',')):
        prompt = torch.randint(0, shape['vocab_size'], (1, context), generator=gen).to(device)
        t0 = time.perf_counter()
        runs = [decode_in_turns(ways, prompt, steps_at_context + 1, recompute_every=8,
                                recompute=recompute) for _ in range(repeats + 1)][1:]
        progress(f"context {context}: {repeats + 1} rounds in {time.perf_counter() - t0:.1f} s")
        again = {r: statistics.mean(s for _, rec, _ in runs for s in rec[(r, way_names[0])])
                 for r in models}
        kv, expert = (sum(t.numel() * t.element_size() for layer in cache.layers for t in
                          (getattr(layer, name) for name in names) if t is not None)
                      for names in (('k', 'v'), ('expert_cache', 'spent')))
        for way in way_names:
            step = {r: statistics.mean(s for c, *_ in runs for s in c[(r, way)][1:])  # no prompt
                    for r in models}
            ratio, spread = speed_ratio(runs, ('seqtopk', way), ('topk', way), skip=1)
            results['decode_context'].append(dict(
                context=context, way=way, topk_ms=step['topk'] * 1e3,
                seqtopk_ms=step['seqtopk'] * 1e3, topk_recompute_ms=again['topk'] * 1e3,
                seqtopk_recompute_ms=again['seqtopk'] * 1e3, kv_cache_bytes=kv,
                expert_cache_bytes=expert))
            print(f"| {context} | {way} | {step['topk'] * 1e3:.2f} | {step['seqtopk'] * 1e3:.2f} "
                  f"| {ratio:.3f} ({spread}) | {again['topk'] * 1e3:.1f} | "
                  f"{again['seqtopk'] * 1e3:.1f} | {again['topk'] / step['topk']:.1f}x, "
                  f"{again['seqtopk'] / step['seqtopk']:.1f}x | {kv / 2**20:.2f} MiB | "
                  f"{expert / 2**10:.1f} KiB ({expert / kv:.2%} of KV) |")


def main():
    if device_type == 'cuda' and not torch.cuda.is_available():
        fail("--device=cuda but no CUDA GPU is visible; use --device=cpu")
    # a GPT compiled per router and size: past torch's default of 8 compiled entries per function
    # the rest would run eagerly, timed as compiled
    torch._dynamo.config.recompile_limit = 64
    keep_freed_cpu_memory()
    gpu = torch.cuda.get_device_name(device) if device_type == 'cuda' else ''
    name = gpu or f'CPU, {torch.get_num_threads()} threads'
    results = dict(device=name, dtype=dtype, compile=compile, torch=torch.__version__,
                   date=time.strftime('%Y-%m-%d'), route=[], train=[], moe=[], decode=[],
                   decode_ratios=[], decode_context=[])
    print(f"seqmoe bench on {name}, {dtype}, compile={compile}, torch {torch.__version__}, "
          f"{results['date']}")
    for section, fn in (('route', bench_route), ('train', lambda r: bench_train(r, gpu)),
                        ('moe', bench_moe), ('decode', bench_decode)):
        if what in ('all', section):
            fn(results)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, 'bench.json'), 'w') as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {os.path.join(out_dir, 'bench.json')}")


if __name__ == '__main__':
    configure(globals(), sys.argv[1:], RULES, RELATIONS)
    device_type = device.split(':')[0]
    main()
