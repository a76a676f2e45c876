"""
Generate text from a trained checkpoint, with the KV cache and the Expert Cache.

    python sample.py --out_dir=out --start="ROMEO:" --max_new_tokens=300
    python sample.py --start=FILE:prompt.txt --color=True   # each token coloured by its experts
    python sample.py --compile=True --temperature=0         # the decoding step compiled
"""
import os
import sys
import time

import torch

import checkpoint as ckpt_io
from configurator import (configure, device_name, non_empty, non_negative, non_negative_int,
                          one_of, positive_int)
import fast
from model import GPT, GPTConfig
from prepare import get_codec
from runtime import autocast_for, keep_freed_cpu_memory, pick_device

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
# what each setting may be (configurator.py), checked before anything runs
RULES = dict(out_dir=non_empty, start=non_empty, num_samples=positive_int,
             max_new_tokens=positive_int, temperature=non_negative,
             sample_top_k=non_negative_int, seed=non_negative_int, device=device_name,
             dtype=one_of('auto', 'float32', 'bfloat16', 'float16'),
             prompt_routing=one_of('online', 'joint'))
RELATIONS = [('prompt_routing', lambda c: c['prompt_routing'] == 'online' or c['use_cache'],
              "'online' with --use_cache=False (recomputing would re-route the prompt)"),
             ('compile', lambda c: not c['compile'] or c['use_cache'],
              "False with --use_cache=False (it compiles the cached decoding step)")]


def main():
    dev = pick_device_or_fail()
    run_dtype, ctx = autocast_for(dev, dtype)  # as train.py
    torch.manual_seed(seed)
    keep_freed_cpu_memory()  # as train.py: large CPU tensors reuse freed memory
    model, meta = load_model(out_dir, dev)
    encode, decode = get_codec(meta)
    x = torch.tensor(prompt_ids(encode, model.config.block_size), dtype=torch.long,
                     device=dev)[None, ...]
    # the step compiled as gpt-fast's generate.py does; eager, every idea in its plain form
    decoder = fast.compiled_decode(model) if compile else None
    if compile:  # compiled once by a short greedy generation (no random draws), timed apart
        t0 = time.time()
        with ctx:
            model.generate(x[:, :1], 2, temperature=0, decode=decoder)
        synchronize(dev)
        print(f"[compiled the decoding step in {time.time() - t0:.1f} s]")
    for _ in range(num_samples):
        experts = ExpertCounts()
        t0 = time.time()
        try:
            with ctx:
                y = model.generate(x, max_new_tokens, temperature=temperature,
                                   sample_top_k=sample_top_k or None, use_cache=use_cache,
                                   prompt_routing=prompt_routing, decode=decoder,
                                   on_token=experts.add if model.routers() else None)
        except ValueError as e:
            fail(e)
        synchronize(dev)
        seconds = time.time() - t0
        per_token = experts.per_token()  # the prompt's and each generated token's
        if color and per_token:
            print(colored(y[0].tolist(), per_token, decode, model.config.top_k))
        else:
            print(decode(y[0].tolist()))
        if experts.generated() is not None:
            print(experts.summary(model.config, ('cached' if use_cache else 'recomputed') +
                                  f', prompt routed {prompt_routing}'))
        print(f"[{max_new_tokens} tokens in {seconds:.2f} s: {max_new_tokens / seconds:.1f} "
              f"tokens/s, {'compiled' if compile else 'eager'}, {run_dtype}]")
        print('---------------')


# -----------------------------------------------------------------------------
# the checkpoint, the prompt, and what generation reports

def fail(message):
    raise SystemExit(f"error: {message}")


def pick_device_or_fail():
    try:
        return pick_device(device)
    except ValueError as e:
        fail(e)


def synchronize(dev):  # the clock reads what the GPU has done
    if device.startswith('cuda'):
        torch.cuda.synchronize()


def load_model(out_dir, device):
    """The model and tokenizer meta from out_dir/ckpt.pt (loaded with weights_only=True)."""
    ckpt_path = os.path.join(out_dir, 'ckpt.pt')
    if not os.path.isfile(ckpt_path):
        fail(f"no checkpoint at {ckpt_path}; train one with `python train.py --out_dir={out_dir}`")
    checkpoint = ckpt_io.load(ckpt_path)
    try:
        model = GPT(GPTConfig(**checkpoint['model_args']))
    except (ValueError, TypeError) as e:
        fail(f"{ckpt_path} has model settings this code cannot build ({e})")
    ckpt_io.load_weights(model, checkpoint, ckpt_path)
    return model.eval().to(device), checkpoint['meta']


def prompt_ids(encode, block_size):
    """--start (or the file it names) as token ids, or one line saying what to change."""
    text = start
    if text.startswith('FILE:'):
        try:
            with open(text[5:], encoding='utf-8') as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            fail(f"--start={text}: cannot read the prompt file "
                 f"({getattr(e, 'strerror', None) or e})")
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
        self.prompt, self.steps = None, []

    def add(self, routing):
        if self.prompt is None:  # the prompt's tokens: per layer, and the mean over layers
            self.prompt_layers = torch.stack([mask[0].sum(-1) for mask, _ in routing]).cpu()
            self.prompt = self.prompt_layers.float().mean(0)
        self.steps.append(torch.stack([mask[0, -1].sum() for mask, _ in routing]))

    def generated(self):
        """(tokens, layers): every generated token but the last went through the MoE layers."""
        if len(self.steps) < 2:
            return None
        return torch.stack(self.steps[1:]).long().cpu()

    def per_token(self):
        counts = self.generated()
        if counts is None:
            return []
        return self.prompt.tolist() + counts.float().mean(1).tolist()

    def per_layer(self):
        """(layers, tokens): the prompt's and each generated token's experts in each layer."""
        return torch.cat([self.prompt_layers, self.generated().t()], dim=1)

    def summary(self, cfg, how):
        counts = self.generated()
        hist = torch.bincount(counts.flatten(), minlength=cfg.n_exp + 1).tolist()
        return (f"[{cfg.router}, top_k={cfg.top_k}, {how}] experts per generated token: mean "
                f"{counts.float().mean():.2f}, min {counts.min().item()}, max "
                f"{counts.max().item()}, per layer "
                f"{[round(v, 2) for v in counts.float().mean(0).tolist()]}, "
                f"histogram (0..{cfg.n_exp} experts) {hist}; the prompt's "
                f"{self.prompt_layers.shape[1]} tokens took {self.prompt_layers.sum(1).tolist()} "
                f"per layer")


def colored(ids, experts, decode, top_k):
    """Text with each token's background coloured by its expert count: blue below top_k, white at
    top_k, red above (ANSI 256 colours; the last token, never fed back, is uncoloured)."""
    palette = [21, 27, 33, 39, 45, 231, 217, 210, 203, 196]  # blue .. white .. red

    def paint(text, f):  # f in [-1, 1]: how far below (-) or above (+) top_k, relative to top_k
        return f"\033[48;5;{palette[min(9, int(5 + 4.5 * f))]}m\033[38;5;16m{text}\033[0m"
    out = []
    for i, token in enumerate(ids):
        text = decode([token])
        if i < len(experts):
            text = paint(text, max(-1.0, min(1.0, (experts[i] - top_k) / max(top_k, 1))))
        out.append(text)
    legend = ' '.join(paint(f" {top_k * (1 + f):.1f} ", f) for f in (-1, -0.5, 0, 0.5, 1))
    return ''.join(out) + f"\n[experts per token: {legend}]"


if __name__ == '__main__':
    configure(globals(), sys.argv[1:], RULES, RELATIONS)
    main()
