"""
Analyses of finished sweep runs that sweep.py's table does not print; results/README.md gives the
command behind each of its numbers.

    python analyze.py --relu_schedule sweeps/explain --top_k=4    # relu's spend by step: a --k_schedule
    python analyze.py --equal_compute sweeps/explain sweeps/explain_more --router=windowtopk
    python analyze.py --window_spend                              # its spend on random scores
    python analyze.py --relu sweeps/explain sweeps/relu_spend_k4 sweeps/relu_compute --top_k=4
    python analyze.py --chars sweeps/explain --top_k=4             # Fig. 5a on characters, taken apart
    python analyze.py --chars ... --out=results/explain_chars      # and its figures

--equal_compute: a router's paired difference from topk at the experts per token it really spent
in training, topk's val CE interpolated per seed between the two integer K around that spend.
--chars: for seqtopk and topk runs of one K, per class of the character predicted (a word's first
letter, a letter inside a word, a space or punctuation): seqtopk's experts per token, the entropy of
its prediction and of topk's, and the loss change of one expert more or fewer at those positions in
the topk model; then how seqtopk's expert count follows its own predictive entropy, topk's (a model
whose compute did not depend on it), and the router's own score spread.
"""
import argparse
import glob
import json
import math
import os
import re
from dataclasses import replace

import numpy as np
import torch

from checkpoint import read_log
from prepare import get_batch
from stats import mean_std, paired_difference, format_difference


def runs_of(roots, router, k):
    """{seed: the done record and folder} of router's runs at K across sweep folders."""
    found = {}
    for root in roots:
        for path in glob.glob(os.path.join(root, f'{router}-k{k}-s*', 'log.jsonl')):
            seed = int(re.search(r'-s(\d+)$', os.path.dirname(path)).group(1))
            done = [r for r in read_log(path) if r.get('event') == 'done']
            if done:
                found[seed] = dict(done[-1], folder=os.path.dirname(path))
    return found


def relu_schedule(roots, k):
    """relu's measured experts per token by step (the mean over its seeds' log lines, rounded),
    as a k_schedule: 'step:k/...', each interval from the step its log line counts from."""
    per_step = {}
    for run in runs_of(roots, 'relu', k).values():
        records = [r for r in read_log(os.path.join(run['folder'], 'log.jsonl')) if r.get('event') == 'train']
        for previous, record in zip([{'iter': 0}] + records, records):
            per_step.setdefault(previous['iter'], []).append(record['experts'])
    if not per_step:
        raise SystemExit(f"error: no finished relu-k{k}-s* runs with experts in their logs in {roots}")
    steps = [(step, max(1, round(float(np.mean(v))))) for step, v in sorted(per_step.items())]
    merged = [s for i, s in enumerate(steps) if i == 0 or s[1] != steps[i - 1][1]]
    return '/'.join(f"{step}:{value}" for step, value in merged), steps


def equal_compute(roots, router, ks):
    """Per K: the router's experts per token (training, evaluation), its val CE, and its paired
    difference from topk at the same K and from topk at its training spend (interpolated)."""
    rows = []
    for k in ks:
        runs = runs_of(roots, router, k)
        if not runs:
            continue
        spend = float(np.mean([r['experts_trained'] for r in runs.values()]))
        low, high = math.floor(spend), math.ceil(spend)
        if spend - low < 0.005:  # within 0.005 of K: topk at K itself, no K+1 runs needed
            high = low
        topk = {kk: runs_of(roots, 'topk', kk) for kk in {k, low, high}}
        at_spend = {}
        for seed, run in runs.items():
            if seed in topk[low] and seed in topk[high]:
                w = min(1.0, run['experts_trained'] - low) if high > low else 0.0
                at_spend[seed] = (1 - w) * topk[low][seed]['val_ce'] + w * topk[high][seed]['val_ce']
        ce = {s: r['val_ce'] for s, r in runs.items()}
        seqtopk = {s: r['val_ce'] for s, r in runs_of(roots, 'seqtopk', k).items()}
        rows.append(dict(K=k, seeds=len(runs), spend_train=spend,
                         vs_seqtopk=paired_difference(ce, seqtopk) if len(set(ce) & set(seqtopk)) > 1 else None,
                         spend_eval=float(np.mean([r['experts_mean'] for r in runs.values()])),
                         val_ce=mean_std(ce.values())[0],
                         vs_topk=paired_difference(ce, {s: r['val_ce'] for s, r in topk[k].items()}),
                         vs_topk_at_spend=paired_difference(ce, at_spend), between=(low, high)))
    return rows


def window_spend(shapes=((8, 2, 8, 1024), (64, 8, 16, 128), (64, 4, 16, 128), (64, 2, 16, 128))):
    """windowtopk's experts per token / K on random softmax scores, floor 1 (their code) and 2:
    per (N, K, B, T) and logit spread (std 1 and 3), no training involved."""
    from router import windowtopk_mask
    rows = []
    for n, k, b, t in shapes:
        for std in (1.0, 3.0):
            g = torch.Generator().manual_seed(0)
            scores = (torch.randn(b, t, n, generator=g) * std).softmax(-1)
            rows.append((n, k, b, t, std, *(float(windowtopk_mask(scores, k, floor).sum()) / (b * t * k)
                                            for floor in (1, 2))))
    return rows


# -----------------------------------------------------------------------------
# relu's lead, taken apart

RELU_GATES = '+score_func=relu+z_loss_weight=0'  # ReMoE's gates (and, as ReMoE, no z-loss)
REMOE = 'relu+relu_l1_per_layer=False+relu_threshold_step=0'  # ReMoE's lambda control exactly


def relu_parts(roots, k):
    """The contrasts that take relu's lead apart at K, paired by seed: (label, row A, row B), each
    row (folder, row name) found in any of roots; relu_spend_k{K} holds the runs that follow relu's
    schedule of experts per token (their rows are named as plain ones)."""
    spend = [r for r in roots if os.path.basename(os.path.normpath(r)) == f'relu_spend_k{k}']
    plain = [r for r in roots if r not in spend]
    k_relu = {8: 10, 4: 6, 2: 5}.get(k, k)  # topk at about relu's mean training spend (K')
    return [
        ("relu − topk (relu's whole lead)", (plain, 'relu'), (plain, 'topk')),
        ("relu − topk at K' = 10, 6, 5 (relu's mean spend)", (plain, 'relu'), (plain, 'topk', k_relu)),
        ("topk following relu's spend − topk (spend over time)", (spend, 'topk'), (plain, 'topk')),
        ("topk at K' − topk (the same mean spend, evenly)", (plain, 'topk', k_relu), (plain, 'topk')),
        ("topk following relu's spend − topk at K' (when the spend comes)", (spend, 'topk'),
         (plain, 'topk', k_relu)),
        ("topk with ReLU gates − topk (gate form)", (plain, 'topk' + RELU_GATES), (plain, 'topk')),
        ("seqtopk with ReLU gates − seqtopk", (plain, 'seqtopk' + RELU_GATES), (plain, 'seqtopk')),
        ("topk, ReLU gates and relu's spend − topk (both)", (spend, 'topk' + RELU_GATES), (plain, 'topk')),
        ("ReLU gates on top of relu's spend (topk)", (spend, 'topk' + RELU_GATES), (spend, 'topk')),
        ("relu − topk following relu's spend (what is left)", (plain, 'relu'), (spend, 'topk')),
        ("relu − topk with ReLU gates and relu's spend (what is left, its gates too)", (plain, 'relu'),
         (spend, 'topk' + RELU_GATES)),
        ("relu as ReMoE (one lambda, no threshold) − relu", (plain, REMOE), (plain, 'relu')),
        ("seqtopk − topk", (plain, 'seqtopk'), (plain, 'topk')),
    ]


def relu_table(roots, ks):
    print("| contrast | " + " | ".join(f"K={k}" for k in ks) + " |")
    print("| --- |" + " --- |" * len(ks))
    labels = [label for label, _, _ in relu_parts(roots, ks[0])]
    for i, label in enumerate(labels):
        cells = []
        for k in ks:
            _, first, second = relu_parts(roots, k)[i]
            a, b = ({s: r['val_ce'] for s, r in runs_of(row[0], row[1], row[2] if len(row) > 2 else k).items()}
                    for row in (first, second))
            cells.append(format_difference(paired_difference(a, b)) if a and b else 'n/a')
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\nrelu's routing at the end (val, per MoE layer): experts per token, tokens given none")
    for k in ks:
        runs = runs_of([r for r in roots if 'relu_spend' not in r], 'relu', k)
        layers = [r['layers'] for r in (final_eval(run['folder']) for run in runs.values())]
        mean = np.mean([[layer['experts_mean'] for layer in run] for run in layers], axis=0)
        none = np.mean([[layer['experts_hist'][0] / sum(layer['experts_hist']) for layer in run]
                        for run in layers], axis=0)
        print(f"K={k}: experts/token per layer {np.round(mean, 2).tolist()}, share of tokens with "
              f"none per layer {np.round(none, 3).tolist()} ({len(runs)} seeds)")


def final_eval(folder):
    return [r for r in read_log(os.path.join(folder, 'log.jsonl')) if r.get('event') == 'eval'][-1]


# -----------------------------------------------------------------------------
# windowtopk's evaluation: what a token being generated can reach

WAYS = (('window', "as its code evaluates (a window of the batch at once)"),
        ('topk', "as generation routed it before (each token its top K: a window of 1 x 1)"),
        ('online', "by the online rule (Eq. 7, its floor, no cap): what sample.py routes"))


def routed_ways(roots, router, k, batches, data_dir):
    """{way: {seed: val CE}} of the router's runs at K on train.py's val batches, routed each of
    the WAYS, {way: experts per token}, and the largest gap between 'window' and the CE each run
    logged (the same number)."""
    from fast import FAST
    from model import GPT
    from sample import load_model
    ce, spend, gap = {way: {} for way, _ in WAYS}, {way: [] for way, _ in WAYS}, 0.0
    for seed, run in sorted(runs_of(roots, router, k).items()):
        model, _ = load_model(run['folder'], 'cpu')
        as_topk = GPT(replace(model.config, router='topk')).eval()
        as_topk.load_state_dict(model.state_dict())
        losses = {way: [] for way, _ in WAYS}
        with torch.no_grad():
            for x, y in val_batches(data_dir, model.config.block_size, batches):
                for way, forward in (('window', lambda: model(x, y, online=False, fast=FAST)),
                                     ('topk', lambda: as_topk(x, y, fast=FAST)),
                                     ('online', lambda: model(x, y, online=True, fast=FAST))):
                    _, loss, aux = forward()
                    experts = np.mean([m.sum(-1).float().mean().item() for m, _ in aux['routing']])
                    losses[way].append((loss.item(), experts))
        for way in ce:
            ce[way][seed] = float(np.mean([loss for loss, _ in losses[way]]))
            spend[way].append(float(np.mean([experts for _, experts in losses[way]])))
        gap = max(gap, abs(ce['window'][seed] - run['val_ce_offline']))
    return ce, {way: float(np.mean(s)) for way, s in spend.items()}, gap


# -----------------------------------------------------------------------------
# Fig. 5a on characters

CLASSES = ('word start', 'inside a word', 'space or punctuation')


def char_classes(itos, x, y):
    """The class of the character each position predicts (B, T): 0 the first letter of a word (the
    input is no letter), 1 a letter inside a word, 2 anything else."""
    letter = torch.tensor([ch.isalpha() for _, ch in sorted(itos.items())])
    return torch.where(letter[y], torch.where(letter[x], 1, 0), 2)


def val_batches(data_dir, block_size, batches, batch_size=16):
    """The first `batches` of train.py's val batches (the same in every run)."""
    data = np.memmap(os.path.join(data_dir, 'val.bin'), dtype=np.uint16, mode='r')
    gen = torch.Generator().manual_seed(1)
    for _ in range(batches):
        yield get_batch(data, block_size, batch_size, gen)


def per_position(model, x, y, ks=None):
    """Each position's cross-entropy, predictive entropy / log V, experts per MoE layer and the
    router's score entropy / log N per layer. ks (B, T): each position's k in every layer (topk
    models only: a token takes its experts of rank < k), else the model's own routing."""
    routers = model.routers()
    if ks is not None:  # an analysis of a trained topk model, never the model's code
        for router in routers:
            router.select = lambda scores, cache, online, fast: (
                scores.argsort(-1, descending=True).argsort(-1) < ks[..., None])
    try:
        with torch.no_grad():
            logits, _, aux = model(x, y)
    finally:
        for router in routers:
            router.__dict__.pop('select', None)
    logp = logits.log_softmax(-1)
    ce = -logp.gather(-1, y[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1) / math.log(logits.shape[-1])
    experts = torch.stack([mask.sum(-1) for mask, _ in aux['routing']])  # (layers, B, T)
    spread = torch.stack([-(s * s.clamp_min(1e-12).log()).sum(-1) / math.log(s.shape[-1])
                          for _, s in aux['routing']])
    return dict(ce=ce, entropy=entropy, experts=experts, spread=spread)


def slope(x, y):
    """The least-squares slope of y on x (token-weighted)."""
    x, y = x.flatten().double(), y.flatten().double()
    return float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())


def correlation(x, y):
    return float(torch.corrcoef(torch.stack([x.flatten().double(), y.flatten().double()]))[0, 1])


def chars(roots, k, batches, data_dir):
    """Per seed with both a seqtopk and a topk run at K: the class table and the slopes."""
    from sample import load_model
    seq_runs, topk_runs = runs_of(roots, 'seqtopk', k), runs_of(roots, 'topk', k)
    results = []
    for seed in sorted(set(seq_runs) & set(topk_runs)):
        seq, meta = load_model(seq_runs[seed]['folder'], 'cpu')
        ref, _ = load_model(topk_runs[seed]['folder'], 'cpu')
        seq.eval(), ref.eval()
        rows = []
        for x, y in val_batches(data_dir, seq.config.block_size, batches):
            cls = char_classes(meta['itos'], x, y)
            s, r = per_position(seq, x, y), per_position(ref, x, y)
            more = {c: per_position(ref, x, y, torch.where(cls == c, k + 1, k))['ce'] for c in range(3)}
            fewer = {c: per_position(ref, x, y, torch.where(cls == c, k - 1, k))['ce']
                     for c in range(3)} if k > 1 else None
            rows.append((cls, s, r, more, fewer))
        cls = torch.cat([row[0] for row in rows])
        s = {key: torch.cat([row[1][key] for row in rows], dim=-2) for key in rows[0][1]}
        r = {key: torch.cat([row[2][key] for row in rows], dim=-2) for key in rows[0][2]}
        experts = s['experts'].float().mean(0)  # (B, T): mean over layers
        table = []
        for c in range(3):
            at = cls == c
            gain = {d: float((torch.cat([row[3 if d == '+1' else 4][c] for row in rows])[at]
                              - r['ce'][at]).mean()) for d in ('+1', '-1') if d == '+1' or k > 1}
            table.append(dict(cls=CLASSES[c], share=float(at.float().mean()),
                              experts=float(experts[at].mean()),
                              entropy_seq=float(s['entropy'][at].mean()),
                              entropy_topk=float(r['entropy'][at].mean()),
                              spread=float(s['spread'].mean(0)[at].mean()),
                              ce_seq=float(s['ce'][at].mean()), ce_topk=float(r['ce'][at].mean()),
                              d_ce_more=gain['+1'], d_ce_fewer=gain.get('-1')))
        per_layer_spread = [correlation(s['spread'][i], s['experts'][i].float())
                            for i in range(s['experts'].shape[0])]
        results.append(dict(
            seed=seed, table=table,
            slope_own=slope(s['entropy'], experts), slope_topk=slope(r['entropy'], experts),
            corr_own=correlation(s['entropy'], experts), corr_topk=correlation(r['entropy'], experts),
            corr_spread=float(np.mean(per_layer_spread)), corr_spread_layers=per_layer_spread,
            corr_spread_entropy=float(np.mean([correlation(s['spread'][i], s['entropy'])
                                               for i in range(s['experts'].shape[0])])),
            binned=binned(s['entropy'], r['entropy'], s['spread'].mean(0), experts)))
    return results


def binned(own, ref, spread, experts, bins=10):
    """Mean experts per token in 10 equal-count bins (deciles) of each measure: own entropy, topk's
    entropy, the router's score spread (mean over layers); each bin's mean value and its tokens."""
    out = {}
    for name, value in (('own', own), ('topk', ref), ('spread', spread)):
        value, n = value.flatten().double(), experts.flatten().double()
        order = value.argsort()
        chunks = [order[i * len(order) // bins:(i + 1) * len(order) // bins] for i in range(bins)]
        out[name] = dict(x=[float(value[c].mean()) for c in chunks],
                         experts=[float(n[c].mean()) for c in chunks], tokens=[len(c) for c in chunks])
    return out


def chars_figure(results, k, out):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    width = 0.8 / len(results)
    for j, result in enumerate(results):
        axes[0].bar([c + (j - (len(results) - 1) / 2) * width for c in range(3)],
                    [row['experts'] for row in result['table']], width=width,
                    label=f"seed {result['seed']}")
    axes[0].axhline(k, color='k', ls='--', lw=1)
    axes[0].set_xticks(range(3), [c.replace(' ', '\n', 1) for c in CLASSES])
    axes[0].set_ylabel('seqtopk experts per token (mean over layers)')
    axes[0].set_title('By the character predicted')
    for ax, name, label in ((axes[1], 'own', "seqtopk's own"), (axes[1], 'topk', "topk's (same seed)"),
                            (axes[2], 'spread', 'router score entropy / log N')):
        for j, result in enumerate(results):
            b = result['binned'][name]
            ax.plot(b['x'], b['experts'],
                    color='C0' if name != 'topk' else 'C1', alpha=0.6,
                    label=label if j == 0 else None, marker='o' if name == 'topk' else '.')
    axes[1].set_xlabel('predictive entropy / log V (deciles of tokens)')
    axes[1].set_title("Fig. 5a: by the model's own entropy and topk's")
    axes[2].set_xlabel("the router's score entropy / log N, mean over layers (deciles)")
    axes[2].set_title("By the router's own uncertainty")
    for ax in axes[1:]:
        ax.axhline(k, color='k', ls='--', lw=1)
        ax.set_ylabel('seqtopk experts per token')
        ax.legend(fontsize=8)
    axes[0].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(f"seqtopk K={k} on characters: where its experts go")
    fig.tight_layout()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f'chars_k{k}.png')
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('roots', nargs='*', help="sweep out_roots holding the runs")
    parser.add_argument('--relu_schedule', action='store_true')
    parser.add_argument('--equal_compute', action='store_true')
    parser.add_argument('--chars', action='store_true')
    parser.add_argument('--relu', action='store_true', help="relu's lead taken apart")
    parser.add_argument('--causal', action='store_true',
                        help="--router's runs evaluated as its code does, as generation did, causally")
    parser.add_argument('--window_spend', action='store_true',
                        help="windowtopk's spend on random scores, floor 1 and 2 (no runs needed)")
    parser.add_argument('--router', default='windowtopk')
    parser.add_argument('--top_k', default='8,4,2')
    parser.add_argument('--batches', type=int, default=20, help="--chars: val batches of 16 x block_size")
    parser.add_argument('--data_dir', default=os.path.join('data', 'shakespeare_char'))
    parser.add_argument('--out', default=None, help="--chars: a folder for its figure")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.top_k.split(',')]
    if args.relu_schedule:
        for k in ks:
            text, steps = relu_schedule(args.roots, k)
            print(f"K={k}: --k_schedule={text}")
    if args.equal_compute:
        print(f"| K | {args.router}: experts/token in training | in evaluation | val CE | "
              f"Δ vs topk at K | topk K′ around its spend | Δ vs topk at its spend | Δ vs seqtopk at K |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for row in equal_compute(args.roots, args.router, ks):
            print(f"| {row['K']} | {row['spend_train']:.3f} | {row['spend_eval']:.3f} | {row['val_ce']} | "
                  f"{format_difference(row['vs_topk'])} | {row['between'][0]}, {row['between'][1]} | "
                  f"{format_difference(row['vs_topk_at_spend'])} | "
                  f"{format_difference(row['vs_seqtopk']) if row['vs_seqtopk'] else 'n/a'} |")
    if args.window_spend:
        print("| experts N | K | windows: B sequences × T/B positions | logit std | ×T·K, floor 1 | floor 2 |")
        print("| --- | --- | --- | --- | --- | --- |")
        for n, k, b, t, std, one, two in window_spend():
            print(f"| {n} | {k} | {b} × {t // b} | {std:g} | {one:.3f} | {two:.3f} |")
    if args.relu:
        relu_table(args.roots, ks)
    if args.causal:
        print(f"| K | {args.router} routed | experts/token | val CE | Δ vs topk at K |")
        print("| --- | --- | --- | --- | --- |")
        for k in ks:
            ce, spend, gap = routed_ways(args.roots, args.router, k, args.batches, args.data_dir)
            topk = {s: r['val_ce'] for s, r in runs_of(args.roots, 'topk', k).items()}
            for way, label in WAYS:
                print(f"| {k} | {label} | {spend[way]:.3f} | {mean_std(ce[way].values())[0]} | "
                      f"{format_difference(paired_difference(ce[way], topk))} |")
            print(f"| {k} | online − window, paired | | | "
                  f"{format_difference(paired_difference(ce['online'], ce['window']))} |")
            print(f"(K={k}: {len(ce['window'])} seeds, {args.batches} val batches; the window's CE "
                  f"is each run's logged val CE to {gap:.1e})")
    if args.chars:
        for k in ks:
            results = chars(args.roots, k, args.batches, args.data_dir)
            print(f"\nK={k}, {len(results)} seeds ({args.batches} val batches each): per class of the "
                  f"character predicted, mean over seeds [min, max]")
            print("| class | share | seqtopk experts/token | entropy (seqtopk) | entropy (topk) | "
                  "router score entropy | CE seqtopk | CE topk | topk ΔCE, one expert more | one fewer |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
            for c in range(3):
                def cell(key, fmt='.3f'):
                    values = [r['table'][c][key] for r in results]
                    if values[0] is None:
                        return ''
                    return f"{np.mean(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"
                print(f"| {CLASSES[c]} | {cell('share', '.2f')} | {cell('experts', '.2f')} | "
                      f"{cell('entropy_seq')} | {cell('entropy_topk')} | {cell('spread', '.4f')} | "
                      f"{cell('ce_seq')} | "
                      f"{cell('ce_topk')} | {cell('d_ce_more', '+.4f')} | {cell('d_ce_fewer', '+.4f')} |")
            for key, label in (('slope_own', "slope of experts on seqtopk's own entropy"),
                               ('slope_topk', "slope of experts on topk's entropy"),
                               ('corr_own', "correlation with its own entropy"),
                               ('corr_topk', "correlation with topk's entropy"),
                               ('corr_spread', "correlation with the router's score entropy (per layer)"),
                               ('corr_spread_entropy', "correlation of router score entropy with predictive entropy")):
                values = [r[key] for r in results]
                print(f"{label}: {np.mean(values):+.3f} (per seed {', '.join(f'{v:+.3f}' for v in values)})")
            if args.out:
                print(f"wrote {chars_figure(results, k, args.out)}")
                with open(os.path.join(args.out, f'chars_k{k}.json'), 'w') as f:
                    json.dump(results, f)


if __name__ == '__main__':
    main()
