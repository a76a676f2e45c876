"""
Benchmarks, measured side by side in one run and printed as Markdown tables.

    python bench.py                          # everything below, on CPU
    python bench.py --what=route             # the routing alone: each router's selection, per call
    python bench.py --what=train             # training step time per router, default and larger model
    python bench.py --what=moe               # the MoE layer alone vs a dense FFN with the same active params
    python bench.py --what=decode            # long context: caches vs recompute, seqtopk vs topk, eager vs compiled
    python bench.py --device=cuda --dtype=bfloat16 --compile=True --json_out=bench.json

Models are randomly initialised (speed does not depend on training). Each time is the median of
`repeats` timed rounds after a warm-up round (`moe_repeats` for the MoE layer), the variants taking
turns in each round; each ratio is the median of the per-round ratios, printed with their middle
half, so a drift between rounds moves neither and the noise is in plain view (decoding: totals over
all rounds, the routers and ways, cached eager, cached compiled and recomputing, taking turns every 16
steps). Targets on CPU: seqtopk / topk training step time <= 1.03; MoE layer / dense FFN (fwd + bwd)
<= 1.5 at 64 experts, top-8; the compiled decoding step >= 2x the eager one's tokens/s for topk, and
compiled seqtopk >= 0.97x compiled topk's speed over the generation; the KV + Expert Cache >= 10x
faster than recomputing at contexts of 512 and more. On a GPU (bf16): MoE / dense <= 1.3 and seqtopk
/ topk step time <= 1.02.
"""
import json
import re
import statistics
import sys
import time
import warnings
from contextlib import nullcontext

import torch
import torch._inductor.config  # bench_decode times the first compile with its caches off
import torch.nn.functional as F

from configurator import Rule, configure, each, non_negative_int, one_of, positive_int
from cache import Cache
from model import GPT, GPTConfig, MoE
from runtime import keep_freed_cpu_memory
from fast import FAST, compiled_decode, online_seqtopk_mask
from router import ROUTERS, batchtopk_mask, seqtopk_mask, step_ks, topk_mask

# -----------------------------------------------------------------------------
what = 'all'              # all | route | train | moe | decode
device = 'cpu'
dtype = 'float32'         # float32 | bfloat16 (autocast; the router stays fp32)
compile = False           # torch.compile the model (train) and the layers (moe)
repeats = 5               # each figure is the median of this many timed runs
seed = 0
json_out = ''             # also write the results here as JSON
# train: the train.py default model and batch, and a larger one
train_steps = 10          # optimizer steps per timed run
# moe: one layer, tokens x n_embd, against a dense FFN of width top_k * exp_dim
moe_tokens = 4096
moe_embd = 256
moe_exp_dim = 128
moe_n_exp = 64
moe_top_k = 8
moe_repeats = 21          # the layers take about a second a round: more rounds settle their ratios
# decode: the larger model with a 1024-token context (character vocabulary)
decode_block_size = 1024
new_tokens = 512          # tokens generated for the cached-vs-recompute comparison
prompt_tokens = 16
contexts = '64,512,960'   # contexts at which per-step decode speed is measured
steps_at_context = 64     # decode steps timed at each context
decode_ways = 'eager,compiled'  # the decoding step eager, compiled (once, then one graph a step), or both
# -----------------------------------------------------------------------------
# what each setting may be (configurator.py), checked before anything runs
RULES = dict(what=one_of('all', 'route', 'train', 'moe', 'decode'), dtype=one_of('float32', 'bfloat16'),
             repeats=positive_int, moe_repeats=positive_int, seed=non_negative_int, train_steps=positive_int,
             moe_tokens=positive_int, moe_embd=positive_int, moe_exp_dim=positive_int, moe_n_exp=positive_int,
             moe_top_k=positive_int, decode_block_size=positive_int, new_tokens=positive_int, prompt_tokens=positive_int,
             contexts=each(positive_int, int),
             steps_at_context=positive_int, decode_ways=each(one_of('eager', 'compiled')),
             device=Rule(lambda v: re.fullmatch(r'cpu|cuda(:\d+)?', v) is not None, 'cpu, cuda or cuda:N'))
RELATIONS = [('moe_top_k', lambda c: c['moe_top_k'] <= c['moe_n_exp'], 'at most --moe_n_exp={moe_n_exp}'),
             ('new_tokens', lambda c: c['prompt_tokens'] + c['new_tokens'] <= c['decode_block_size'],
              'at most --decode_block_size={decode_block_size} minus --prompt_tokens={prompt_tokens}'),
             ('contexts', lambda c: max(int(x) for x in c['contexts'].split(',')) + c['steps_at_context']
              <= c['decode_block_size'], 'contexts of at most --decode_block_size={decode_block_size} '
              'minus --steps_at_context={steps_at_context}')]
configure(globals(), sys.argv[1:], RULES, RELATIONS)
# one process compiles a GPT per router and size: each is one more entry in the same functions' caches, and past
# torch's default of 8 the rest would run eagerly, timed as if compiled
torch._dynamo.config.recompile_limit = 64
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}[dtype]
device_type = 'cuda' if device.startswith('cuda') else 'cpu'
autocast = (lambda: torch.autocast(device_type=device_type, dtype=ptdtype)) if dtype != 'float32' else nullcontext
DEFAULT = dict(n_layer=4, n_head=4, n_embd=128, n_exp=8, top_k=2, exp_dim=128, block_size=128, vocab_size=77)
LARGER = dict(n_layer=6, n_head=8, n_embd=256, n_exp=16, top_k=4, exp_dim=256, block_size=256, vocab_size=77)


def sync():
    if device_type == 'cuda':
        torch.cuda.synchronize()


def interleaved(fns, rounds=None):
    """Seconds of each fn in each of `rounds` (default `repeats`) rounds after a warm-up round, the
    fns taking turns in every round, so that a drift in the machine's speed affects them alike."""
    times = {name: [] for name in fns}
    for round in range(-1, rounds or repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if round >= 0:  # round -1 warms up
                times[name].append(time.perf_counter() - t0)
    return times


def ratio_in_rounds(times, name, base):
    """name's time over base's, round by round (each pair measured back to back): the median and the
    middle half of those ratios, a ratio that a drift between rounds does not move, and its noise."""
    ratios = [t / b for t, b in zip(times[name], times[base])]
    low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return statistics.median(ratios), f"{low:.2f}-{high:.2f}"


def peak_memory(fn):
    """Peak bytes allocated on the GPU while fn() runs (None on CPU, where torch does not track it)."""
    if device_type != 'cuda':
        return None
    torch.cuda.reset_peak_memory_stats()
    fn()
    return torch.cuda.max_memory_allocated()


def cache_bytes(cache, names):
    """Bytes of a Cache's buffers of these names, over its layers (KV: k, v; Expert Cache: the rest)."""
    tensors = [getattr(layer, name) for layer in cache.layers for name in names]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def build(router, shape, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(router=router, **{**shape, **kw})).to(device)


# -----------------------------------------------------------------------------
def bench_route(results):
    """The selection alone, scores -> mask, for one batch of 16x128 tokens: what each router adds to a
    training or evaluation forward before any expert runs."""
    print("\n### Routing: scores (16 x 128 tokens x N experts) -> mask, one call\n")
    print("| experts | router (path) | µs / call | vs topk |")
    print("| --- | --- | --- | --- |")
    for n_exp, k in ((8, 2), (64, 8)):
        logits = torch.randn(16, 128, n_exp, generator=torch.Generator().manual_seed(seed)).to(device)
        scores = logits.softmax(-1)
        paths = {'topk': lambda: topk_mask(scores, k),
                 'seqtopk (training: offline)': lambda: seqtopk_mask(scores, k),
                 'seqtopk (causal evaluation: online)': lambda: online_seqtopk_mask(scores, k, 1, k + 2),
                 'batchtopk (training)': lambda: batchtopk_mask(scores, k),
                 'batchtopk (evaluation: threshold)': lambda: scores > 1 / n_exp,
                 'relu': lambda: F.relu(logits) > 0}
        with torch.no_grad():
            times = interleaved({name: (lambda fn: lambda: [fn() for _ in range(20)])(fn) for name, fn in paths.items()})
        for name, t in times.items():
            us, (ratio, _) = statistics.median(t) / 20 * 1e6, ratio_in_rounds(times, name, 'topk')
            results['route'].append(dict(n_exp=n_exp, top_k=k, path=name, us_per_call=us, ratio_vs_topk=ratio))
            print(f"| {n_exp}, top-{k} | {name} | {us:.0f} | {ratio:.2f} |")


def bench_train(results):
    """Training step time (forward + backward + AdamW) per router, at two model sizes."""
    print(f"\n### Training step (forward + backward + AdamW), {train_steps} steps per run\n")
    print("| model | batch | router | ms / step | vs topk (middle half of rounds) | peak memory | MFU (active params) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    peak_flops = 989e12 if device_type == 'cuda' else None  # H100/H200 dense bf16; MFU only on GPU
    for name, shape, batch in (('default', DEFAULT, 16), ('larger', LARGER, 16)):
        T = shape['block_size']
        gen = torch.Generator().manual_seed(seed)
        x = torch.randint(0, shape['vocab_size'], (batch, T), generator=gen).to(device)
        y = torch.randint(0, shape['vocab_size'], (batch, T), generator=gen).to(device)
        runs, models = {}, {}
        for router in ROUTERS:
            models[router] = model = build(router, shape).train()
            step_model = torch.compile(model) if compile else model
            opt = model.configure_optimizers(0.1, 1e-4, (0.9, 0.99), device_type)

            def run(step_model=step_model, opt=opt, cfg=model.config, n_moe=len(model.routers())):
                for _ in range(train_steps):
                    # each layer's k drawn outside the model, as train.py does (mrltopk: a fresh draw every step)
                    moe_ks = step_ks(cfg, n_moe)
                    with autocast():
                        _, ce, aux = step_model(x, y, moe_ks=moe_ks, fast=FAST)
                    (ce + aux['aux_loss']).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            runs[router] = run
        times = interleaved(runs)
        seconds = {router: statistics.median(t) / train_steps for router, t in times.items()}
        for router, model in models.items():
            memory = peak_memory(runs[router])
            mfu = None
            if peak_flops:  # 6 flops per active parameter per token, plus attention (nanoGPT's estimate)
                cfg = model.config
                flops_per_token = 6 * model.num_params(active=True) + 12 * cfg.n_layer * cfg.n_embd * T
                mfu = flops_per_token * batch * T / seconds[router] / peak_flops
            ratio, spread = ratio_in_rounds(times, router, 'topk')
            results['train'].append(dict(model=name, batch=batch, router=router, ms_per_step=seconds[router] * 1e3,
                                         ratio_vs_topk=ratio, ratio_middle_half=spread, peak_memory_bytes=memory,
                                         mfu=mfu))
            print(f"| {name} ({model.num_params() / 1e6:.1f}M, {model.num_params(active=True) / 1e6:.1f}M active) "
                  f"| {batch}x{T} | {router} | {seconds[router] * 1e3:.1f} | {ratio:.3f} ({spread}) | "
                  f"{'n/a' if memory is None else f'{memory / 2**20:.0f} MiB'} | "
                  f"{'n/a' if mfu is None else f'{mfu:.1%}'} |")


# -----------------------------------------------------------------------------
def bench_moe(results):
    """The MoE layer (router + dispatch + experts) against a dense FFN with the same active params."""
    C, H, N, k = moe_embd, moe_exp_dim, moe_n_exp, moe_top_k
    print(f"\n### MoE layer vs dense FFN: {moe_tokens} tokens x {C}, {N} experts of width {H}, top-{k} "
          f"(dense FFN width {k * H}), forward + backward\n")
    print("| layer | ms | vs dense (middle half of rounds) |")
    print("| --- | --- | --- |")
    torch.manual_seed(seed)
    x = torch.randn(1, moe_tokens, C, device=device, requires_grad=True)
    dense = torch.nn.Sequential(torch.nn.Linear(C, k * H, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(k * H, C, bias=False)).to(device)
    layers = {'dense FFN': dense}
    for router in ('topk', 'seqtopk'):
        for impl in ('grouped', 'loop'):
            cfg = GPTConfig(n_embd=C, n_exp=N, top_k=k, exp_dim=H, router=router, moe_impl=impl)
            torch.manual_seed(seed)
            moe = MoE(cfg).to(device)
            torch.nn.init.normal_(moe.w_fc, std=0.02)
            torch.nn.init.normal_(moe.w_proj, std=0.02)
            layers[f'MoE {router}, {impl}'] = (lambda m: (lambda inp: m(inp, fast=FAST)[0]))(moe)
            if router == 'topk' and impl == 'grouped':  # the plain model's experts, for contrast
                layers['MoE topk, textbook loop'] = (lambda m: (lambda inp: m(inp)[0]))(moe)
    runs = {}
    for name, layer in layers.items():
        fn = torch.compile(layer) if compile and 'textbook' not in name else layer

        def run(fn=fn):
            with autocast():
                out = fn(x)
            out.float().square().mean().backward()
        runs[name] = run
    times = interleaved(runs, moe_repeats)
    for name, t in times.items():
        ms, (ratio, spread) = statistics.median(t) * 1e3, ratio_in_rounds(times, name, 'dense FFN')
        results['moe'].append(dict(layer=name, ms=ms, ratio_vs_dense=ratio, ratio_middle_half=spread))
        print(f"| {name} | {ms:.2f} | {ratio:.2f} ({spread}) |")


# -----------------------------------------------------------------------------
@torch.inference_mode()
def decode_in_turns(ways, prompt, steps, recompute_every=1, block=16, recompute=()):
    """Greedy decoding of `steps` tokens after `prompt` in every way, name -> (model, step), as GPT.generate
    decodes: the prompt eagerly into a Cache, then one token a step through step (model.decode_token, the
    plain definitions, or fast.compiled_decode); the ways named in `recompute` also recompute the whole
    context, eagerly (at every `recompute_every`-th step). The
    ways take turns every `block` steps: cached steps follow each other as in generation, and a drift in
    the machine's speed hits all alike. Returns, per way, the seconds of each cached step (step 0 is the
    prompt), the seconds of each recompute, the Cache at the end, and the tokens."""
    caches = {name: Cache(model.config) for name, (model, _) in ways.items()}
    idx, last = dict.fromkeys(ways, prompt), {}
    cached, recomputed = {name: [] for name in ways}, {name: [] for name in ways}
    with autocast():  # --dtype=bfloat16: one bf16 region over the whole generation, as sample.py's
        for first in range(0, steps, block):
            turn = range(first, min(steps, first + block))
            for name, (model, step) in ways.items():
                for i in turn:
                    sync()
                    t0 = time.perf_counter()
                    logits = model(idx[name], cache=caches[name])[0] if i == 0 else step(last[name], caches[name])[0]
                    sync()
                    cached[name].append(time.perf_counter() - t0)
                    last[name] = logits[:, -1].argmax(-1, keepdim=True)
                    idx[name] = torch.cat([idx[name], last[name]], dim=1)
            for name, (model, _) in ways.items():
                for i in (i for i in turn if i % recompute_every == 0 and name in recompute):
                    t0 = time.perf_counter()
                    model(idx[name][:, :prompt.shape[1] + i], online=True)  # what generate(use_cache=False) runs
                    sync()
                    recomputed[name].append(time.perf_counter() - t0)
    return cached, recomputed, caches, idx


warnings.filterwarnings('ignore', message='dynamo_pgo force disabled')  # bench_decode's cold compiles: as meant
CAPPED = 'compiled, experts capped at top_k'  # see bench_decode


def bench_decode(results):
    """Long-context generation: the KV + Expert Cache against recomputing the context every step, seqtopk
    against topk, the decoding step eager and compiled, all taking turns; then one step at a given context.
    Compiled, seqtopk also runs with its experts capped at topk's top_k slots: a timing of what its routing
    and Expert Cache add to the step, apart from the experts a token takes beyond top_k (its text differs).
    Each figure is the total over all rounds' steps; the per-round spread of each ratio shows the noise."""
    shape = dict(LARGER, block_size=decode_block_size)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, shape['vocab_size'], (1, prompt_tokens), generator=gen).to(device)
    models = {router: build(router, shape).eval() for router in ('topk', 'seqtopk')}
    way_names = decode_ways.split(',')
    ways = {(router, way): (model, compiled_decode(model) if way == 'compiled' else model.decode_token)
            for router, model in models.items() for way in way_names}
    if 'compiled' in way_names:  # seqtopk's routing and Expert Cache with topk's expert work: top_k slots a token
        capped = build('seqtopk', shape).eval()
        ways[('seqtopk', CAPPED)] = (capped, compiled_decode(capped, slots=capped.config.top_k))
    # decode_in_turns takes generate's steps: the same tokens as generate(temperature=0), checked here; the
    # first compiled generation compiles the step, timed apart and from cold (inductor's on-disk caches
    # unused: a user's first compile, not a rerun's)
    compile_s = {}
    for (router, way), (model, step) in ways.items():
        t0 = time.perf_counter()
        with autocast(), torch._inductor.config.patch(force_disable_caches=True):
            generated = model.generate(prompt, 16, temperature=0, decode=step)
        sync()
        if way != 'eager':
            compile_s[(router, way)] = time.perf_counter() - t0
        if not torch.equal(decode_in_turns({(router, way): ways[(router, way)]}, prompt, 16)[3][(router, way)],
                           generated):
            raise SystemExit(f"error: bench's decoding loop and generate() disagree for {router}, {way}")
    decode_in_turns(ways, prompt, 16)  # a warm-up of the turns themselves

    def speed_ratio(runs, name, base, skip=0):  # name's cached speed over base's: all rounds, and each round's
        total = {n: sum(sum(cached[n][skip:]) for cached, *_ in runs) for n in (name, base)}
        rounds = [sum(cached[base][skip:]) / sum(cached[name][skip:]) for cached, *_ in runs]
        return total[base] / total[name], f"{min(rounds):.2f}-{max(rounds):.2f}"

    print(f"\n### Decoding: {new_tokens} new tokens after a {prompt_tokens}-token prompt, larger model with a "
          f"{decode_block_size}-token context (greedy, batch 1; the ways taken in turns" +
          (f"; compiled: the decoding step compiled once, cold, in {compile_s[('topk', 'compiled')]:.0f} s for topk and "
           f"{compile_s[('seqtopk', 'compiled')]:.0f} s for seqtopk" if compile_s else '') + ")\n")
    print("| router | decoding step | KV + Expert Cache tok/s | full recompute tok/s (eager) | speed-up |")
    print("| --- | --- | --- | --- | --- |")
    recompute = {(router, way_names[0]) for router in models}  # the model's own forward, which is eager
    runs = [decode_in_turns(ways, prompt, new_tokens, recompute=recompute)
            for _ in range(min(repeats, 3))]  # a minute a round on CPU
    for router, way in ways:
        cached = sum(sum(c[(router, way)]) for c, *_ in runs) / len(runs)
        recomputed = sum(sum(r[(router, way_names[0])]) for _, r, *_ in runs) / len(runs)
        results['decode'].append(dict(router=router, way=way, new_tokens=new_tokens, block_size=decode_block_size,
                                      cached_tok_s=new_tokens / cached, recompute_tok_s=new_tokens / recomputed,
                                      compile_s=compile_s.get((router, way))))
        print(f"| {router} | {way} | {new_tokens / cached:.1f} | {new_tokens / recomputed:.1f} "
              f"| {recomputed / cached:.1f}x |")
    print()
    for name, base, label in ((('seqtopk', 'eager'), ('topk', 'eager'), 'seqtopk / topk, eager'),
                              (('seqtopk', 'compiled'), ('topk', 'compiled'), 'seqtopk / topk, compiled'),
                              (('topk', 'compiled'), ('topk', 'eager'), 'compiled / eager, topk'),
                              (('seqtopk', 'compiled'), ('seqtopk', 'eager'), 'compiled / eager, seqtopk'),
                              (('seqtopk', CAPPED), ('topk', 'compiled'), f'seqtopk {CAPPED} / topk, compiled')):
        if name not in ways or base not in ways:
            continue
        ratio, spread = speed_ratio(runs, name, base)
        results['decode_ratios'].append(dict(ratio=label, value=ratio, rounds=spread))
        print(f"{label} cached decode speed: {ratio:.3f} (rounds: {spread})")
    print(f"\n### One decode step at a given context ({steps_at_context} cached steps and "
          f"{steps_at_context // 8 + 1} full recomputes, one every 8 steps, in each of {repeats} rounds)\n")
    print("| context | decoding step | topk cached ms | seqtopk cached ms | seqtopk / topk speed (rounds) "
          "| topk recompute ms | seqtopk recompute ms | cache speed-up (topk, seqtopk) | KV cache | Expert Cache |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ways = {name: ways[name] for name in ways if name[1] in way_names}
    for context in (int(c) for c in contexts.split(',')):
        prompt = torch.randint(0, shape['vocab_size'], (1, context), generator=gen).to(device)
        runs = [decode_in_turns(ways, prompt, steps_at_context + 1, recompute_every=8, recompute=recompute)
                for _ in range(repeats + 1)][1:]
        again = {r: statistics.mean(s for _, rec, *_ in runs for s in rec[(r, way_names[0])]) for r in models}
        kv, expert = (cache_bytes(runs[-1][2][('seqtopk', way_names[0])], names) for names in (('k', 'v'), ('expert_cache', 'spent')))
        for way in way_names:
            step = {r: statistics.mean(s for c, *_ in runs for s in c[(r, way)][1:]) for r in models}  # not the prompt
            ratio, spread = speed_ratio(runs, ('seqtopk', way), ('topk', way), skip=1)
            results['decode_context'].append(dict(
                context=context, way=way, topk_ms=step['topk'] * 1e3, seqtopk_ms=step['seqtopk'] * 1e3,
                topk_recompute_ms=again['topk'] * 1e3, seqtopk_recompute_ms=again['seqtopk'] * 1e3,
                kv_cache_bytes=kv, expert_cache_bytes=expert))
            print(f"| {context} | {way} | {step['topk'] * 1e3:.2f} | {step['seqtopk'] * 1e3:.2f} | {ratio:.3f} ({spread}) "
                  f"| {again['topk'] * 1e3:.1f} | {again['seqtopk'] * 1e3:.1f} | {again['topk'] / step['topk']:.1f}x, "
                  f"{again['seqtopk'] / step['seqtopk']:.1f}x | {kv / 2**20:.2f} MiB | {expert / 2**10:.1f} KiB "
                  f"({expert / kv:.2%} of KV) |")


def main():
    if device_type == 'cuda' and not torch.cuda.is_available():
        raise SystemExit("error: --device=cuda but no CUDA GPU is visible")
    if device_type == 'cuda':
        torch.backends.cuda.matmul.allow_tf32 = True
    keep_freed_cpu_memory()
    name = torch.cuda.get_device_name(device) if device_type == 'cuda' else f'CPU, {torch.get_num_threads()} threads'
    results = dict(device=name, dtype=dtype, compile=compile, torch=torch.__version__,
                   date=time.strftime('%Y-%m-%d'), route=[], train=[], moe=[], decode=[], decode_ratios=[],
                   decode_context=[])
    print(f"seqmoe bench on {name}, {dtype}, compile={compile}, torch {torch.__version__}, {results['date']}")
    for section, fn in (('route', bench_route), ('train', bench_train), ('moe', bench_moe), ('decode', bench_decode)):
        if what in ('all', section):
            fn(results)
    if json_out:
        with open(json_out, 'w') as f:
            json.dump(results, f, indent=2)
        print(f"\nwrote {json_out}")


if __name__ == '__main__':
    main()
