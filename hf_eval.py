"""
The paper's training-free measurements on a Hugging Face MoE model (hf.py), and a sample:

    python hf_eval.py --model=allenai/OLMoE-1B-7B-0924           # the table, and Fig. 1a
    python hf_eval.py --model=allenai/OLMoE-1B-7B-0924 --mode=fig1a --batches=40
    python hf_eval.py --model=allenai/OLMoE-1B-7B-0924 --mode=sample --start="The moon"

table: the val CE of topk and seqtopk at K, K/2 and K/4 (the model's K first), seqtopk offline
(Eq. 5) and causal (Eq. 7, as generate routes), each paired by batch with topk at its K (the mean
difference and its 95% t-interval over the batches, as experiments/analyze.py reports seeds).
Fig. 1a: how much each token's probability of the next token changes when K drops to 3K/4 or K/2
(topk; and seqtopk at K/2), a histogram. sample: greedy text after --start, seqtopk at --top_k
in generate with the Expert Cache. Text: a prepare.py dataset (data/NAME), a local text file, or
a `datasets` dataset (a hub name or a local file) whose validation split (or held-out 10%) is read.
"""
import contextlib
import io
import json
import os
import sys

import numpy as np
import torch
from torch.nn import functional as F

import hf
from configurator import (autocast_for, configure, device_name, fail, non_empty, one_of,
                          pick_device, positive_int)
from experiments.compare import format_difference, markdown, paired_difference

# -----------------------------------------------------------------------------
model = 'allenai/OLMoE-1B-7B-0924'  # a hub name or a local folder (save_pretrained's)
text = 'shakespeare_char'  # a prepare.py dataset (data/NAME), a local text file, or a datasets name
text_column = 'text'       # a datasets dataset's column of text
mode = 'table'             # 'table' (and Fig. 1a), 'fig1a' (only its forwards), 'sample'
block_size = 512           # tokens per sequence
batch_size = 4
batches = 10               # the first batches of consecutive sequences of the validation text
top_k = 0                  # sample: seqtopk's K (0: the model's)
start = 'The'              # sample: the prompt
max_new_tokens = 100       # sample
device = 'auto'
dtype = 'auto'             # 'auto' (bf16 on GPUs that have it, else float32), 'float32', ...
out_dir = 'out-hf'         # table.md, fig1a.png, fig1a.json
# -----------------------------------------------------------------------------
RULES = dict(model=non_empty, text=non_empty, mode=one_of('table', 'fig1a', 'sample'),
             block_size=positive_int, batch_size=positive_int, batches=positive_int,
             max_new_tokens=positive_int, device=device_name, out_dir=non_empty,
             dtype=one_of('auto', 'float32', 'bfloat16', 'float16'))


def validation_text(name, column):
    """The text to measure on: a prepare.py dataset's val.bin decoded, a file, or a dataset."""
    from checkpoint import check_data
    from prepare import get_codec, load_splits
    folder = os.path.join('data', name)
    if os.path.isdir(folder):
        try:
            meta = check_data(folder, 1)
        except ValueError as e:
            fail(e)
        ids = np.fromfile(os.path.join(folder, 'val.bin'), dtype=np.uint16).tolist()
        return get_codec(meta)[1](ids)
    if os.path.isfile(name) and name.endswith('.txt'):
        return open(name, encoding='utf-8').read()
    return '\n\n'.join(load_splits(name, column, 0.1)['val'][column][:10000])


def sequences(ids, n_batches):
    """Consecutive (x, y) batches (batch_size, block_size) of the token ids, the first n."""
    per_batch = batch_size * (block_size + 1)
    if len(ids) < per_batch:
        fail(f"the text has {len(ids)} tokens, fewer than one batch's {per_batch} "
             f"(--batch_size x (--block_size + 1)): give more text or smaller sizes")
    n = min(n_batches, len(ids) // per_batch)
    rows = torch.tensor(ids[:n * per_batch]).view(n, batch_size, block_size + 1)
    return [(r[:, :-1], r[:, 1:]) for r in rows]


@torch.no_grad()
def measure(lm, batch_list, ways, dev):
    """Per way (name, router, k, online): {batch: CE}, the experts per token it took, and
    each token's probability of the next (n tokens,)."""
    ce, spend, prob = {w[0]: {} for w in ways}, {w[0]: [] for w in ways}, {w[0]: [] for w in ways}
    for name, router, k, online in ways:
        with hf.routed(lm, router, top_k=k, online=online):
            lm.seqmoe.record = taken = []
            for i, (x, y) in enumerate(batch_list):
                logits = lm(x.to(dev)).logits.float()  # (B, T, V)
                ce[name][i] = F.cross_entropy(logits.flatten(0, 1), y.flatten().to(dev)).item()
                prob[name].append(logits.softmax(-1).gather(-1, y.to(dev)[..., None]).flatten())
                spend[name] += [m.sum(-1).float().mean().item() for *_, m in taken]
                taken.clear()
    return (ce, {name: float(np.mean(s)) for name, s in spend.items()},
            {name: torch.cat(p).cpu() for name, p in prob.items()})


def table(ks, ce, spend):
    """The markdown table: each way's CE and its paired difference from topk at its K."""
    rows = [[k, name.split(' K=')[0], f"{spend[name]:.2f}", f"{np.mean(list(c.values())):.4f}",
             '' if name.startswith('topk') else
             format_difference(paired_difference(c, ce[f"topk K={k}"]))]
            for k in ks for name, c in ce.items() if name.endswith(f" K={k}")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        markdown(['K', 'routing', 'experts/token', 'val CE', 'Δ vs topk at K, paired by batch '
                  '(95%)'], rows)
    return out.getvalue()


def fig1a(prob, names, path):
    """Fig. 1a: each token's |change| in p(next token) from topk at K (names[0]) to each other
    way (topk at 3K/4 and K/2, seqtopk at K/2), a histogram per way."""
    import matplotlib
    matplotlib.use('Agg')  # files only
    from experiments.plot import figure, finish, save_figure
    fig, ax = figure(f"Fig. 1a: p(next token) routed otherwise than {names[0]}",
                     "|change in probability|", "share of tokens")
    changes, lines = {}, []
    for name in names[1:]:
        change = (prob[names[0]] - prob[name]).abs().numpy()
        changes[name] = change.tolist()
        ax.hist(change, bins=40, range=(0, 1), weights=np.full(len(change), 1 / len(change)),
                alpha=0.5, label=name)
        lines.append(f"{name}: {np.mean(change <= 0.05):.0%} of tokens change by at most 0.05, "
                     f"{np.mean(change > 0.5):.0%} by more than 0.5")
    print(f"wrote {save_figure(finish(fig, ax), os.path.dirname(path), os.path.basename(path))}")
    json.dump(changes, open(path.replace('.png', '.json'), 'w'))
    return '\n'.join(lines)


def sample(lm, tokenizer, dev):
    """Greedy text after --start, seqtopk in generate: each new token by Eq. 7."""
    ids = tokenizer(start, return_tensors='pt').to(dev)
    with hf.routed(lm, 'seqtopk', top_k=top_k) as routed:
        routed.seqmoe.record = taken = []
        out = routed.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        steps = taken[len(routed.seqmoe.blocks):]  # after the prompt's forward: a token each
        k = routed.seqmoe.k
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    if steps:
        per_token = torch.cat([m.sum(-1).flatten() for *_, m in steps]).float()
        print(f"[seqtopk K={k} with the Expert Cache: experts per generated token and layer: "
              f"mean {per_token.mean():.2f}, min {int(per_token.min())}, max "
              f"{int(per_token.max())}]")


def main():
    try:
        dev = pick_device(device)
    except ValueError as e:
        fail(e)
    run_dtype = autocast_for(dev, dtype)[0]
    try:
        lm, tokenizer = hf.from_pretrained(model, getattr(torch, run_dtype))
        lm = hf.route(lm.to(dev), 'topk')  # refused here if hf.py cannot route it
        hf.unroute(lm)
        if mode == 'sample':
            return sample(lm, tokenizer, dev)
    except ValueError as e:
        fail(e)
    K = lm.config.num_experts_per_tok
    ks = [k for k in dict.fromkeys((K, K // 2, K // 4)) if k >= 1]  # the table's
    kinds = (('topk', 'topk', False), ('seqtopk offline', 'seqtopk', False),
             ('seqtopk causal', 'seqtopk', True))
    ways = {f"{name} K={k}": (router, k, online) for k in ks for name, router, online in kinds
            if mode == 'table'}
    figure = [f"topk K={k}" for k in dict.fromkeys((K, 3 * K // 4, K // 2)) if k >= 1] + [
        f"seqtopk offline K={K // 2}"] * (K > 1)  # Fig. 1a's: topk at K first
    ways |= {name: (name.split()[0], int(name.split('=')[1]), False) for name in figure}
    need = batches * batch_size * (block_size + 1)  # tokens; a token is at least a character
    ids = tokenizer(validation_text(text, text_column)[:need * 20])['input_ids']
    batch_list = sequences(ids, batches)
    ce, spend, prob = measure(lm, batch_list, [(name, *way) for name, way in ways.items()], dev)
    os.makedirs(out_dir, exist_ok=True)
    report = table(ks, ce, spend) + (
        f"\n{model}, {len(batch_list)} batches of {batch_size} x {block_size} tokens of "
        f"{text}, {run_dtype}\n")
    if mode == 'table':
        print(report, end='')
        open(os.path.join(out_dir, 'table.md'), 'w').write(report)
    if K > 1:
        print(fig1a(prob, figure, os.path.join(out_dir, 'fig1a.png')))


if __name__ == '__main__':
    configure(globals(), sys.argv[1:], RULES)
    main()
