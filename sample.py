"""
Generate text from a trained checkpoint with the KV cache and the Expert Cache (generate): eager,
the plain definitions, or the decoding step compiled as gpt-fast compiles it (compiled_decode).

    python sample.py --out_dir=out --start="ROMEO:" --max_new_tokens=300
    python sample.py --start=FILE:prompt.txt --color=True   # each token coloured by its experts
    python sample.py --compile=True --temperature=0         # the decoding step compiled
"""
import functools
import os
import sys
import time

import torch
from torch.nn import functional as F

import checkpoint as ckpt
import fast
from cache import Cache, LayerCache, static
from configurator import (a_seed, autocast_for, configure, device_name, fail,
                          keep_freed_cpu_memory, non_empty, non_negative, non_negative_int, one_of,
                          pick_device, positive_int)
from model import GPT, GPTConfig
from prepare import get_codec

# -----------------------------------------------------------------------------
out_dir = 'out'            # where train.py wrote ckpt.pt
start = '\n'               # the prompt, or FILE:path to read it from a file
num_samples = 2
max_new_tokens = 300
temperature = 0.8          # 0 = greedy
sample_top_k = 200         # sample among the most likely tokens only (0 = all)
seed = 1337
device = 'auto'
dtype = 'auto'             # 'auto' (bf16 on GPUs that have it, else float32), 'float32', ...
use_cache = True           # the KV cache and the Expert Cache (False: recompute every step)
prompt_routing = 'online'  # 'online': the prompt token by token, as generation; 'joint': at once
compile = False            # compile the cached decoding step (CUDA: replayed as a CUDA graph)
color = False              # colour each token by the experts it took, mean over MoE layers
# -----------------------------------------------------------------------------
RULES = dict(out_dir=non_empty, start=non_empty, num_samples=positive_int,
             max_new_tokens=positive_int, temperature=non_negative,
             sample_top_k=non_negative_int, seed=a_seed, device=device_name,
             dtype=one_of('auto', 'float32', 'bfloat16', 'float16'),
             prompt_routing=one_of('online', 'joint'))
RELATIONS = [('prompt_routing', lambda c: c['prompt_routing'] == 'online' or c['use_cache'],
              "'online' with --use_cache=False (recomputing would re-route the prompt)"),
             ('compile', lambda c: not c['compile'] or c['use_cache'],
              "False with --use_cache=False (it compiles the cached decoding step)")]


def main():
    try:
        dev = pick_device(device)
    except ValueError as e:
        fail(e)
    run_dtype, ctx = autocast_for(dev, dtype)  # as train.py
    torch.manual_seed(seed)
    keep_freed_cpu_memory()  # as train.py: large CPU tensors reuse freed memory
    model, meta = load_model(out_dir, dev)
    encode, decode = get_codec(meta)
    x = torch.tensor(prompt_ids(encode, model.config.block_size), device=dev)[None, ...]  # (1, T)
    decoder = compiled_decode(model) if compile else None  # None: eager, the plain definitions
    cache = (StaticCache if compile else Cache)(model.config)  # reused: buffers stay put
    if compile:  # compiled (on CUDA, its graph recorded) by a short greedy generation, timed apart
        t0 = time.time()
        with ctx:
            generate(model, x[:, :1], 4, temperature=0, decode=decoder, cache=cache)
        synchronize(dev)
        print(f"[compiled the decoding step in {time.time() - t0:.1f} s]")
    for _ in range(num_samples):
        experts, clock = ExpertCounts(), []

        def on_token(routing):
            if not clock:  # the prompt is in: the clock counts the decoding steps only
                synchronize(dev)
                clock.append(time.time())
            if routing:
                experts.add(routing)
        try:
            with ctx:
                y = generate(model, x, max_new_tokens, temperature=temperature, use_cache=use_cache,
                             sample_top_k=sample_top_k or None, prompt_routing=prompt_routing,
                             decode=decoder, on_token=on_token, cache=cache)
        except ValueError as e:
            fail(e)
        synchronize(dev)
        seconds = time.time() - clock[0]
        ids, per_token = y[0].tolist(), experts.per_token()
        print(colored(ids, per_token, decode, model.config.top_k) if color and per_token
              else decode(ids))
        if experts.generated() is not None:
            print(experts.summary(model.config, ('cached' if use_cache else 'recomputed') +
                                  f', prompt routed {prompt_routing}'))
        steps = max_new_tokens - 1  # the tokens after the first, which the prompt's forward gives
        how = f"{'compiled' if compile else 'eager'}, {run_dtype}"
        print(f"[{max_new_tokens} tokens; the {steps} after the first in {seconds:.2f} s: "
              f"{steps / max(seconds, 1e-9):.1f} tokens/s, {how}]" if steps else
              f"[1 token, from the prompt's forward: no decoding step to time; {how}]")
        print('---------------')


# -----------------------------------------------------------------------------
# the generation loop
@torch.inference_mode()
def generate(model, idx, max_new_tokens, temperature=1.0, sample_top_k=None, use_cache=True,
             prompt_routing='online', on_token=None, decode=None, cache=None):
    """Sample max_new_tokens after idx (B, T), with a Cache (KV + Expert Cache) or recomputing the
    context each step: the same tokens and routing. A full context starts again at its last half
    (block_size // 2 tokens, at least 1), routed anew. prompt_routing: 'online' (token by token) or
    'joint' (one sequence, as the paper's code); on_token(routing) sees each step's routing;
    decode: compiled_decode's (default: the model's own decode_token); cache: one to reuse (a
    compiled step's CUDA graph is recorded once)."""
    block_size = model.config.block_size
    if prompt_routing not in ('online', 'joint'):
        raise ValueError(f"prompt_routing must be 'online' or 'joint', not {prompt_routing}")
    if not use_cache and (prompt_routing == 'joint' or decode is not None):
        raise ValueError("prompt_routing='joint' and a decoding step need use_cache=True")
    if cache is None:
        cache = (Cache if decode is None else StaticCache)(model.config)
    step = decode or model.decode_token  # (idx, cache, online) -> logits, routing
    start, idx_next = max(0, idx.shape[1] - block_size), None  # the context's start
    for i in range(max_new_tokens):
        full = idx.shape[1] - start > block_size
        if full:  # the context starts again at its last half
            start = idx.shape[1] - max(1, block_size // 2)
        if not use_cache or i == 0 or full:  # recomputing, the prompt, or the context started again
            if use_cache:
                cache.reset()
            logits, routing = step(idx[:, start:], cache if use_cache else None,
                                   prompt_routing == 'online' or i > 0)
        else:  # the token sampled last (its own tensor: a slice has other strides)
            logits, routing = step(idx_next, cache)
        if on_token is not None:
            on_token(routing)
        logits = logits[:, -1, :].float()
        if temperature <= 0:  # greedy
            idx_next = logits.argmax(dim=-1, keepdim=True)
        else:  # the largest logit taken away first and a temperature float32 holds: no NaN
            tiny = torch.finfo(torch.float32).tiny  # below it: as it, greedy in effect
            logits = (logits - logits.amax(-1, keepdim=True)) / max(temperature, tiny)
            if sample_top_k is not None:
                v, _ = torch.topk(logits, min(sample_top_k, logits.size(-1)))
                logits = logits.masked_fill(logits < v[:, [-1]], -float('inf'))
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


# -----------------------------------------------------------------------------
# the compiled decoding step: each token's experts in a fixed number of slots (fast paths)
def slot_pairs(mask, gates, slots):
    """Each token's experts in `slots` slots (M, slots), those it takes first, and their gates; a
    slot it does not take holds its first expert again with gate 0 (no other weights are read)."""
    taken, expert = mask.to(gates.dtype).topk(slots, dim=-1)
    expert = torch.where(taken > 0, expert, expert[:, :1])
    return expert, gates.gather(-1, expert) * taken


def slot_experts(x, expert, gate, w_fc, w_proj):
    """model.moe_loop over (M, slots) experts and gates, each pair's weights gathered (as gpt-fast
    decodes Mixtral; cast after the gather: a bf16 step reads only the experts it uses)."""
    M, C = x.shape
    expert = expert.flatten()
    h = F.gelu(torch.bmm(x.repeat_interleave(gate.shape[1], dim=0).unsqueeze(1),
                         w_fc.index_select(0, expert).to(x.dtype)))  # (P, 1, H)
    y = torch.bmm(h * gate.reshape(-1, 1, 1), w_proj.index_select(0, expert).to(x.dtype))
    return y.view(M, -1, C).sum(dim=1)


def decode_slots(router):
    """A decoding step's slots: the most experts one token takes (topk: k; SeqTopK: its upper bound,
    Eq. 5's), or None (no bound): Router.most_k."""
    return router.most_k()


def decode_experts(x, mask, gates, w_fc, w_proj, router, slots=None):
    """A decoding step's experts, each token's in `slots` slots (default decode_slots; no bound:
    fast.sorted_experts). On the CPU, where reading a count waits for nothing, only as many slots
    as a token takes, two at least (a size the compiled step reads: capture_scalar_outputs; two
    leave inductor's one-row matmul pass nothing to ask of it)."""
    slots = slots or decode_slots(router)
    if slots is None:
        return fast.sorted_experts(x, mask, gates, w_fc, w_proj, router)
    if not x.is_cuda:  # a token taking fewer: slots of gate 0
        slots = torch.sym_max(min(2, slots), torch.sym_min(int(mask.sum(-1).max()), slots))
    return slot_experts(x, *slot_pairs(mask, gates, slots), w_fc, w_proj)


class StaticCache(Cache):
    """cache.Cache with each layer's Expert Cache in a static buffer of block_size rows written in
    place at the position, the rows past it ignored: a compiled decoding step is one graph."""

    def new_layer(self):
        return StaticLayerCache(self)

    def holds(self, B):  # its buffers made for a batch of B: a compiled step cannot make them
        return self.pos is not None and all(layer.k is not None and layer.k.shape[0] == B
                                            for layer in self.layers)


class StaticLayerCache(LayerCache):

    def expert_past(self):  # the buffer, and how many of its rows are written (for the counting)
        return self.expert_cache, self.spent, self.cache.pos

    def append_experts(self, rows, mask):
        B, T, R = rows.shape
        if self.expert_cache is None or self.expert_cache.shape[0] != B:
            self.expert_cache = static(rows.new_zeros(B, self.cache.block_size, R))
            self.spent = static(torch.zeros(B, dtype=torch.long, device=rows.device))
        pos = self.cache.pos + torch.arange(T, device=rows.device)  # (T,)
        self.expert_cache.index_copy_(1, pos, rows)
        self.spent.add_(mask.sum(dim=(1, 2)))

    def reset(self):  # keeping the buffers
        if self.spent is not None:
            self.spent.zero_()


# inductor's settings for the CPU step, where every matmul has one row (one token)
CPU_DECODE_OPTIONS = {
    'cpp_wrapper': True,  # the step's kernel calls in C++, no interpreter between them
    'post_grad_fusion_options': {'decompose_mm_pass': {}},  # one-row matmuls as fused reductions
    'realize_opcount_threshold': 4,  # an expert's activations stored once, not recomputed per read
}


def compiled_decode(model, slots=None):
    """model.decode_token by the fast paths, as a decode(idx, cache, online=True) for generate: the
    prompt (and a fresh cache's first token) eagerly, each later token by a step (experts in
    `slots` slots) compiled once (fullgraph; CUDA: a CUDA graph). cache: a StaticCache. The model
    is left as it was."""
    cuda = next(model.parameters()).is_cuda
    prompt = fast.paths(model)
    step = fast.paths(model, experts=lambda router: functools.partial(
        decode_experts, router=router, slots=slots))
    compiled = torch.compile(step.decode_token, fullgraph=True,
                             mode='reduce-overhead' if cuda else None,
                             options=None if cuda else CPU_DECODE_OPTIONS)

    def decode(idx, cache, online=True):
        if not isinstance(cache, StaticCache):  # else the step would compile every token
            raise ValueError("a compiled decoding step decodes with a StaticCache")
        # the prompt, or a fresh cache's first token (a one-token prompt): eagerly, making its
        # buffers before the compiled step
        if idx.shape[1] > 1 or not online or not cache.holds(idx.shape[0]):
            return prompt.decode_token(idx, cache, online)
        if idx.is_cuda:  # static slots; the last step's outputs are read: replay
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(idx, cache)
        with torch._dynamo.config.patch(capture_scalar_outputs=True):  # the CPU's slot count
            return compiled(idx, cache)
    return decode


# -----------------------------------------------------------------------------
# the checkpoint, the prompt, and what generation reports
def synchronize(dev):  # the clock reads what the GPU has done
    if dev.startswith('cuda'):
        torch.cuda.synchronize(dev)


def load_model(out_dir, device):
    """The model and tokenizer meta from out_dir/ckpt.pt (loaded with weights_only=True)."""
    ckpt_path = os.path.join(out_dir, 'ckpt.pt')
    if not os.path.isfile(ckpt_path):
        fail(f"no checkpoint at {ckpt_path}; train one with `python train.py --out_dir={out_dir}`")
    checkpoint = ckpt.load(ckpt_path)
    try:
        model = GPT(GPTConfig(**checkpoint['model_args']))
    except (ValueError, TypeError) as e:
        fail(f"{ckpt_path} has model settings this code cannot build ({e})")
    ckpt.load_weights(model, checkpoint, ckpt_path)
    return model.eval().to(device), checkpoint['meta']


def prompt_ids(encode, block_size):
    """--start (or the file it names) as token ids, or one line saying what to change."""
    text = start
    if text.startswith('FILE:'):
        try:
            with open(text[5:], encoding='utf-8') as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            reason = getattr(e, 'strerror', None) or e
            fail(f"--start={text}: cannot read the prompt file ({reason})")
    try:
        ids = encode(text)
    except ValueError as e:
        fail(f"{e}; change --start")
    if not ids:
        fail("--start is empty; give at least one character or token")
    if len(ids) > block_size:
        fail(f"the prompt is {len(ids)} tokens, longer than the model's context of {block_size}; "
             f"shorten --start")
    return ids


class ExpertCounts:
    """The experts each MoE layer gave each token, from generate's on_token: kept on the device
    (reading them each step would wait on a GPU)."""

    def __init__(self):
        self.prompt_layers, self.steps = None, []  # prompt_layers: (layers, prompt tokens)

    def add(self, routing):
        if self.prompt_layers is None:
            self.prompt_layers = torch.stack([mask[0].sum(-1) for mask, _ in routing]).cpu()
        self.steps.append(torch.stack([mask[0, -1].sum() for mask, _ in routing]))

    def generated(self):
        """(tokens, layers): every generated token but the last went through the MoE layers."""
        return torch.stack(self.steps[1:]).long().cpu() if len(self.steps) > 1 else None

    def per_token(self):
        """Each token's experts (mean over layers), the prompt's and the generated's, or []."""
        if self.prompt_layers is None:
            return []
        counts = self.generated()
        generated = counts.float().mean(1).tolist() if counts is not None else []
        return self.prompt_layers.float().mean(0).tolist() + generated

    def per_layer(self):
        """(layers, tokens): the prompt's and each generated token's experts in each layer."""
        return torch.cat([self.prompt_layers, self.generated().t()], dim=1)

    def summary(self, cfg, how):
        counts = self.generated()
        hist = torch.bincount(counts.flatten(), minlength=cfg.n_exp + 1).tolist()
        return (f"[{cfg.router}, top_k={cfg.top_k}, {how}] experts per generated token: mean "
                f"{counts.float().mean():.2f}, min {counts.min().item()}, max "
                f"{counts.max().item()}, per layer "
                f"{[round(v, 2) for v in counts.float().mean(0).tolist()]}, histogram "
                f"(0..{cfg.n_exp} experts) {hist}; the prompt's {self.prompt_layers.shape[1]} "
                f"tokens took {self.prompt_layers.sum(1).tolist()} per layer")


def shade(experts, top_k):
    """A token's colour, from its expert count: -1 (none) .. 0 (top_k) .. +1 (2 * top_k or more);
    sample.py paints it in the terminal, plot.py's token pictures in a figure."""
    return max(-1.0, min(1.0, (experts - top_k) / max(top_k, 1)))


def colored(ids, experts, decode, top_k):
    """Text with each token's background coloured by its expert count (shade): blue below top_k,
    white at top_k, red above (ANSI 256 colours; the last token, never fed back, is uncoloured)."""
    palette = [21, 27, 33, 39, 45, 231, 217, 210, 203, 196]  # blue .. white .. red

    def paint(text, f):
        return f"\033[48;5;{palette[min(9, int(5 + 4.5 * f))]}m\033[38;5;16m{text}\033[0m"
    pieces, start = [], 0
    for end in range(1, len(ids) + 1):  # a character whose bytes span tokens (BPE): one piece
        piece = decode(ids[start:end])
        if piece.endswith('\ufffd') and end - start < 4 and end < len(ids):
            continue  # its first token's colour
        pieces.append(paint(piece, shade(experts[start], top_k)) if start < len(experts)
                      else piece)
        start = end
    text = ''.join(pieces)
    legend = ' '.join(paint(f" {top_k * (1 + f):.1f} ", f) for f in (-1, -0.5, 0, 0.5, 1))
    return text + f"\n[experts per token: {legend}]"


if __name__ == '__main__':
    configure(globals(), sys.argv[1:], RULES, RELATIONS)
    main()
