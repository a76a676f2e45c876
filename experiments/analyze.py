"""
Analyses of finished sweep runs that sweep.py's table does not print; results/README.md gives the
command behind each of its numbers.

    python experiments/analyze.py --relu_schedule sweeps/explain --top_ks=4  # relu's spend by step
    python experiments/analyze.py --equal_compute sweeps/explain --router=windowtopk
    python experiments/analyze.py --causal sweeps/windowtopk_causal --router=windowtopk --top_ks=4,2
    python experiments/analyze.py --window_spend          # windowtopk's spend on random scores
    python experiments/analyze.py --relu sweeps/explain sweeps/relu_spend_k4 --top_ks=4
    python experiments/analyze.py --chars sweeps/explain --top_ks=4 --out_dir=results/explain_chars
"""
import glob
import json
import math
import os
import re
import sys
from dataclasses import replace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the model's files

from plot import save_figure, side_by_side
from checkpoint import get_batch, read_run
from compare import format_difference, last_done, markdown, mean_std, paired_difference
from configurator import arg_parser, fail
from stats import predictive_entropy
from sweep import IGNORED, recorded


def runs_of(roots, router, k, like=None, compared=()):
    """{seed: the done record and folder} of router's training runs at K across sweep folders;
    each made as like[seed] was (like: such runs) but for what names them (router, K, a variant's
    +settings), `compared` and where it ran, else one line naming the settings that differ."""
    folders = (f for root in roots for f in glob.glob(os.path.join(root, f'{router}-k{k}-s*')))
    runs = {int(re.search(r'-s(\d+)$', folder).group(1)): dict(done, folder=folder)
            for folder in folders if (done := last_done(folder))}
    for seed in sorted(set(runs) & set(like or {})):
        pair = like[seed]['folder'], runs[seed]['folder']
        a, b = (recorded(folder)['config'] or {} for folder in pair)
        free = {*IGNORED, *compared, 'router', 'top_k', *re.findall(r'\+(\w+)=', ''.join(pair))}
        if differ := sorted(n for n in (a.keys() | b.keys()) - free if a.get(n) != b.get(n)):
            fail(f"{pair[0]} and {pair[1]} differ in " + ', '.join(
                f"--{n} ({a.get(n)!r}, {b.get(n)!r})" for n in differ) + " besides what is "
                "compared; give sweep folders whose runs differ only in that")
    return runs


def val_ce(runs):
    return {seed: run['val_ce'] for seed, run in runs.items()}


def relu_schedule(roots, k):
    """relu's measured experts per token by step (mean over its seeds' log lines, rounded) as a
    k_schedule 'step:k/...', each interval from the step its log line counts from."""
    per_step = {}
    for run in runs_of(roots, 'relu', k).values():
        records = read_run(run['folder'])['train']
        for previous, record in zip([{'iter': 0}] + records, records):
            per_step.setdefault(previous['iter'], []).append(record['experts'])
    if not per_step:
        fail(f"no finished relu-k{k}-s* runs with experts in their logs in {roots}")
    steps = [(step, max(1, round(float(np.mean(v))))) for step, v in sorted(per_step.items())]
    merged = [s for i, s in enumerate(steps) if i == 0 or s[1] != steps[i - 1][1]]
    return '/'.join(f"{step}:{value}" for step, value in merged)


def equal_compute(roots, router, ks):
    """Per K: the router's experts per token (training, evaluation), its val CE, and its paired
    difference from topk at K, from topk at its training spend (interpolated) and from seqtopk."""
    rows = []
    for k in ks:
        runs = runs_of(roots, router, k)  # main checked there are some
        spend = float(np.mean([r['experts_trained'] for r in runs.values()]))
        low = math.floor(spend)
        high = low if spend - low < 0.005 else math.ceil(spend)  # within 0.005 of K: no K+1 runs
        topk = {kk: val_ce(runs_of(roots, 'topk', kk, like=runs)) for kk in {k, low, high}}
        at_spend = {}
        for seed, run in runs.items():
            if seed in topk[low] and seed in topk[high]:
                w = min(1.0, run['experts_trained'] - low) if high > low else 0.0
                at_spend[seed] = (1 - w) * topk[low][seed] + w * topk[high][seed]
        ce, seqtopk = val_ce(runs), val_ce(runs_of(roots, 'seqtopk', k, like=runs))
        rows.append(dict(K=k, seeds=len(runs), spend_train=spend, between=(low, high),
                         spend_eval=float(np.mean([r['experts_mean'] for r in runs.values()])),
                         val_ce=mean_std(ce.values())[0], vs_topk=paired_difference(ce, topk[k]),
                         vs_topk_at_spend=paired_difference(ce, at_spend),
                         vs_seqtopk=(paired_difference(ce, seqtopk)
                                     if len(set(ce) & set(seqtopk)) > 1 else None)))
    return rows


def window_spend(shapes=((8, 2, 8, 1024), (64, 8, 16, 128), (64, 4, 16, 128), (64, 2, 16, 128))):
    """The table of windowtopk's experts per token / K on random softmax scores, floor 1 (their
    code) and 2: per (N, K, B, T) and logit spread (std 1 and 3), no training involved."""
    from router import windowtopk_mask
    rows = []
    for n, k, b, t in shapes:
        for std in (1.0, 3.0):
            g = torch.Generator().manual_seed(0)
            scores = (torch.randn(b, t, n, generator=g) * std).softmax(-1)
            one, two = (float(windowtopk_mask(scores, k, floor).sum()) / (b * t * k)
                        for floor in (1, 2))
            rows.append([n, k, f"{b} × {t // b}", f"{std:g}", f"{one:.3f}", f"{two:.3f}"])
    markdown(['experts N', 'K', 'windows: B sequences × T/B positions', 'logit std',
              '×T·K, floor 1', 'floor 2'], rows)


# -----------------------------------------------------------------------------
# relu's lead, taken apart

RELU_GATES = '+score_func=relu+z_loss_weight=0'  # ReMoE's gates (and, as ReMoE, no z-loss)
REMOE = 'relu+relu_l1_per_layer=False+relu_threshold_step=0'  # ReMoE's lambda control exactly


def relu_parts(roots, k):
    """(label, row A, row B) per contrast that takes relu's lead apart at K, a row (folders,
    router, K); relu_spend_k{K} holds topk runs that follow relu's spend (--relu_schedule)."""
    spend = [r for r in roots if os.path.basename(os.path.normpath(r)) == f'relu_spend_k{k}']
    plain = [r for r in roots if r not in spend]
    k_relu = {8: 10, 4: 6, 2: 5}.get(k, k)  # topk at about relu's mean training spend (K')
    relu, topk, seqtopk = (plain, 'relu', k), (plain, 'topk', k), (plain, 'seqtopk', k)
    at_k_relu, follows = (plain, 'topk', k_relu), (spend, 'topk', k)
    gates, follows_gates = (plain, 'topk' + RELU_GATES, k), (spend, 'topk' + RELU_GATES, k)
    return [
        ("relu − topk (relu's whole lead)", relu, topk),
        ("relu − topk at K' = 10, 6, 5 (relu's mean spend)", relu, at_k_relu),
        ("topk following relu's spend − topk (spend over time)", follows, topk),
        ("topk at K' − topk (the same mean spend, evenly)", at_k_relu, topk),
        ("topk following relu's spend − topk at K' (when the spend comes)", follows, at_k_relu),
        ("topk with ReLU gates − topk (gate form)", gates, topk),
        ("seqtopk with ReLU gates − seqtopk", (plain, 'seqtopk' + RELU_GATES, k), seqtopk),
        ("topk, ReLU gates and relu's spend − topk (both)", follows_gates, topk),
        ("ReLU gates on top of relu's spend (topk)", follows_gates, follows),
        ("relu − topk following relu's spend (what is left)", relu, follows),
        ("relu − topk with ReLU gates and relu's spend (what is left, its gates too)", relu,
         follows_gates),
        ("relu as ReMoE (one lambda, no threshold) − relu", (plain, REMOE, k), relu),
        ("seqtopk − topk", seqtopk, topk),
    ]


def relu_table(roots, ks):
    table = [[label] for label, _, _ in relu_parts(roots, ks[0])]
    for k in ks:
        for row, (_, a, b) in zip(table, relu_parts(roots, k)):
            compared = ['k_schedule'] * (a[0] != b[0])  # a spend sweep's topk: relu's schedule
            a = runs_of(*a)
            a, b = val_ce(a), val_ce(runs_of(*b, like=a, compared=compared))
            row.append(format_difference(paired_difference(a, b)) if a and b else 'n/a')
    markdown(['contrast', *(f"K={k}" for k in ks)], table)
    print("\nrelu's routing at the end (val, per MoE layer): experts per token, tokens given none")
    for k in ks:
        runs = runs_of([r for r in roots if 'relu_spend' not in r], 'relu', k)
        layers = [read_run(run['folder'])['eval'][-1]['layers'] for run in runs.values()]
        mean = np.mean([[layer['experts_mean'] for layer in run] for run in layers], axis=0)
        none = np.mean([[layer['experts_hist'][0] / sum(layer['experts_hist']) for layer in run]
                        for run in layers], axis=0)
        print(f"K={k}: experts/token per layer {np.round(mean, 2).tolist()}, share of tokens with "
              f"none per layer {np.round(none, 3).tolist()} ({len(runs)} seeds)")


# -----------------------------------------------------------------------------
# a router's evaluation: what a token being generated can reach

WAYS = ('own', 'topk', 'online')  # a router's runs routed as it evaluates, as topk, online
ROUTED = dict(  # per router: the short name of its own way, then each way's row
    windowtopk=('window', "as its code evaluates (a window of the batch at once)",
                "as generation routed it before (each token its top K: a window of 1 x 1)",
                "by the online rule (Eq. 7, its floor, no cap): what sample.py routes"),
    seqtopk=('offline', "offline, as it trains (Eq. 5: each sequence's top T·K at once)",
             "as topk (each token its top K)",
             "by the online rule (Eq. 7, within its bounds): what sample.py routes"))


def routed_ways(roots, router, k, batches, data_dir):
    """{way: {seed: val CE}} of the router's runs at K routed each of the WAYS, {way: experts per
    token}, {seed: val CE} of topk's run of each seed on the same batches (its logged CE is on
    others), and the largest gap between 'own' and each run's logged CE (the same number)."""
    import fast
    from model import GPT
    from sample import load_model
    ce, spend, gap = {way: {} for way in WAYS}, {way: [] for way in WAYS}, 0.0
    runs, topk_ce = runs_of(roots, router, k), {}
    topk_runs = runs_of(roots, 'topk', k, like=runs)
    for seed, run in sorted(runs.items()):
        model, _ = load_model(run['folder'], 'cpu')
        as_topk = GPT(replace(model.config, router='topk')).eval()
        as_topk.load_state_dict(model.state_dict())
        model, as_topk = fast.paths(model), fast.paths(as_topk)
        topk_model = fast.paths(load_model(topk_runs[seed]['folder'], 'cpu')[0]) \
            if seed in topk_runs else None
        losses, topk_losses = {way: [] for way in WAYS}, []
        with torch.no_grad():
            for x, y in val_batches(data_dir, model.config.block_size, batches):
                outputs = dict(own=model(x, y, online=False), topk=as_topk(x, y),
                               online=model(x, y, online=True))
                for way, (_, loss, aux) in outputs.items():
                    experts = np.mean([m.sum(-1).float().mean().item() for m, _ in aux['routing']])
                    losses[way].append((loss.item(), experts))
                if topk_model is not None:
                    topk_losses.append(topk_model(x, y)[1].item())
        for way in ce:
            ce[way][seed] = float(np.mean([loss for loss, _ in losses[way]]))
            spend[way].append(float(np.mean([experts for _, experts in losses[way]])))
        if topk_losses:
            topk_ce[seed] = float(np.mean(topk_losses))
        gap = max(gap, abs(ce['own'][seed] - run['val_ce_offline']))
    return ce, {way: float(np.mean(s)) for way, s in spend.items()}, topk_ce, gap


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
    """Each position's CE, predictive entropy / log V, experts and router score entropy / log N
    per layer; ks (B, T): each position's k in a topk model (else the model's own routing)."""
    routers = model.routers()
    if ks is not None:  # an analysis of a trained topk model, never the model's code
        for router in routers:
            router.select = lambda choice: (
                choice.argsort(-1, descending=True).argsort(-1) < ks[..., None])
    try:
        with torch.no_grad():
            logits, _, aux = model(x, y)
    finally:
        for router in routers:
            router.__dict__.pop('select', None)
    ce = -logits.log_softmax(-1).gather(-1, y[..., None])[..., 0]
    entropy = predictive_entropy(logits)  # / log V
    experts = torch.stack([mask.sum(-1) for mask, _ in aux['routing']])  # (layers, B, T)
    spread = torch.stack([-(s * s.clamp_min(1e-12).log()).sum(-1) / math.log(s.shape[-1])
                          for _, s in aux['routing']])
    return dict(ce=ce, entropy=entropy, experts=experts, spread=spread)


def joined(batches):
    """Per-batch {key: (..., B, T)} joined along the batch."""
    return {key: torch.cat([b[key] for b in batches], dim=-2) for key in batches[0]}


def slope(x, y):
    """The least-squares slope of y on x (token-weighted)."""
    x, y = x.flatten().double(), y.flatten().double()
    return float(((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum())


def correlation(x, y):
    return float(torch.corrcoef(torch.stack([x.flatten().double(), y.flatten().double()]))[0, 1])


def chars(roots, k, batches, data_dir):
    """Per seed with both a seqtopk and a topk run at K: the class table and the slopes."""
    from sample import load_model
    seq_runs = runs_of(roots, 'seqtopk', k)
    topk_runs = runs_of(roots, 'topk', k, like=seq_runs)
    deltas = (1, -1) if k > 1 else (1,)  # topk given one expert more (fewer) at a class
    results = []
    for seed in sorted(set(seq_runs) & set(topk_runs)):
        seq, meta = load_model(seq_runs[seed]['folder'], 'cpu')
        ref, _ = load_model(topk_runs[seed]['folder'], 'cpu')
        parts = []  # per batch: classes, seqtopk's and topk's measures, topk's CE at k +- 1
        for x, y in val_batches(data_dir, seq.config.block_size, batches):
            cls = char_classes(meta['itos'], x, y)
            parts.append((cls, per_position(seq, x, y), per_position(ref, x, y),
                          {(d, c): per_position(ref, x, y, torch.where(cls == c, k + d, k))['ce']
                           for d in deltas for c in range(3)}))
        cls = torch.cat([p[0] for p in parts])
        s, r, shifted = (joined([p[i] for p in parts]) for i in (1, 2, 3))
        experts = s['experts'].float().mean(0)  # (B, T): mean over layers
        measures = dict(experts=experts, entropy_seq=s['entropy'], entropy_topk=r['entropy'],
                        spread=s['spread'].mean(0), ce_seq=s['ce'], ce_topk=r['ce'])
        table = []
        for c in range(3):
            at = cls == c
            gain = {d: float((shifted[(d, c)][at] - r['ce'][at]).mean()) for d in deltas}
            table.append(dict(cls=CLASSES[c], share=float(at.float().mean()),
                              **{key: float(value[at].mean()) for key, value in measures.items()},
                              d_ce_more=gain[1], d_ce_fewer=gain.get(-1)))
        per_layer_spread = [correlation(sp, e.float()) for sp, e in zip(s['spread'], s['experts'])]
        spread_entropy = [correlation(sp, s['entropy']) for sp in s['spread']]  # per layer
        results.append(dict(
            seed=seed, table=table,
            slope_own=slope(s['entropy'], experts), slope_topk=slope(r['entropy'], experts),
            corr_own=correlation(s['entropy'], experts),
            corr_topk=correlation(r['entropy'], experts),
            corr_spread=float(np.mean(per_layer_spread)), corr_spread_layers=per_layer_spread,
            corr_spread_entropy=float(np.mean(spread_entropy)),
            binned=binned(s['entropy'], r['entropy'], measures['spread'], experts)))
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
                         experts=[float(n[c].mean()) for c in chunks],
                         tokens=[len(c) for c in chunks])
    return out


def chars_figure(results, k):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for j, result in enumerate(results):
        side_by_side(axes[0], j, len(results), [row['experts'] for row in result['table']],
                     label=f"seed {result['seed']}")
    axes[0].set_xticks(range(3), [c.replace(' ', '\n', 1) for c in CLASSES])
    axes[0].set_ylabel('seqtopk experts per token (mean over layers)')
    axes[0].set_title('By the character predicted')
    for ax, name, label in ((axes[1], 'own', "seqtopk's own"),
                            (axes[1], 'topk', "topk's (same seed)"),
                            (axes[2], 'spread', 'router score entropy / log N')):
        for j, result in enumerate(results):
            b = result['binned'][name]
            ax.plot(b['x'], b['experts'], color='C0' if name != 'topk' else 'C1', alpha=0.6,
                    label=label if j == 0 else None, marker='o' if name == 'topk' else '.')
        ax.set_ylabel('seqtopk experts per token')
    axes[1].set_xlabel('predictive entropy / log V (deciles of tokens)')
    axes[1].set_title("Fig. 5a: by the model's own entropy and topk's")
    axes[2].set_xlabel("the router's score entropy / log N, mean over layers (deciles)")
    axes[2].set_title("By the router's own uncertainty")
    for ax in axes:
        ax.axhline(k, color='k', ls='--', lw=1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7 if ax is axes[0] else 8)
    fig.suptitle(f"seqtopk K={k} on characters: where its experts go")
    fig.tight_layout()
    return fig


def print_chars(results, k, batches):
    print(f"\nK={k}, {len(results)} seeds ({batches} val batches each): per class of the "
          f"character predicted, mean over seeds [min, max]")
    def cell(c, key, fmt):  # mean over seeds [min, max]
        values = [r['table'][c][key] for r in results]
        return ('' if values[0] is None else
                f"{np.mean(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]")
    formats = dict(share='.2f', experts='.2f', entropy_seq='.3f', entropy_topk='.3f', spread='.4f',
                   ce_seq='.3f', ce_topk='.3f', d_ce_more='+.4f', d_ce_fewer='+.4f')
    markdown(['class', 'share', 'seqtopk experts/token', 'entropy (seqtopk)', 'entropy (topk)',
              'router score entropy', 'CE seqtopk', 'CE topk', 'topk ΔCE, one expert more',
              'one fewer'],
             [[CLASSES[c], *(cell(c, key, fmt) for key, fmt in formats.items())] for c in range(3)])
    for key, label in (('slope_own', "slope of experts on seqtopk's own entropy"),
                       ('slope_topk', "slope of experts on topk's entropy"),
                       ('corr_own', "correlation with its own entropy"),
                       ('corr_topk', "correlation with topk's entropy"),
                       ('corr_spread', "correlation with the router's score entropy (per layer)"),
                       ('corr_spread_entropy',
                        "correlation of router score entropy with predictive entropy")):
        values = [r[key] for r in results]
        print(f"{label}: {np.mean(values):+.3f} "
              f"(per seed {', '.join(f'{v:+.3f}' for v in values)})")


def main(argv=None):
    parser = arg_parser(__doc__)
    parser.add_argument('roots', nargs='*', help="the out_dirs of the sweeps holding the runs")
    parser.add_argument('--relu_schedule', action='store_true',
                        help="relu's experts per token by step, as a --k_schedule for topk")
    parser.add_argument('--equal_compute', action='store_true', help="--router vs topk at the "
                        "experts/token it spent in training (topk interpolated between two K)")
    parser.add_argument('--chars', action='store_true', help="seqtopk vs topk by the character "
                        "predicted: experts/token, entropies, topk's CE at K + 1 and K - 1")
    parser.add_argument('--relu', action='store_true', help="relu's lead taken apart")
    parser.add_argument('--causal', action='store_true', help="--router's runs routed as its code "
                        "evaluates, as generation did (each token its top K), and online")
    parser.add_argument('--window_spend', action='store_true',
                        help="windowtopk's spend on random scores, floor 1 and 2 (no runs needed)")
    parser.add_argument('--router', help="--equal_compute, --causal: the router compared with topk")
    parser.add_argument('--top_ks', default='8,4,2')
    parser.add_argument('--batches', type=int, default=20, help="val batches of 16 x block_size")
    parser.add_argument('--dataset', default='shakespeare_char', help="a folder under data/")
    parser.add_argument('--out_dir', help="--chars: a folder for its figure and numbers")
    args = parser.parse_args(argv)
    if (args.equal_compute or args.causal) and not args.router:
        parser.error("--equal_compute and --causal compare a --router with topk: give --router")
    if not re.fullmatch(r'[1-9]\d*(,[1-9]\d*)*', args.top_ks):
        parser.error(f"--top_ks={args.top_ks} must be a comma-separated list of positive integers")
    ks, data_dir = [int(k) for k in args.top_ks.split(',')], os.path.join('data', args.dataset)
    # the runs each analysis reads: every one must be there, else one line before any table
    needs = dict(relu_schedule=['relu'], equal_compute=[args.router, 'topk'],
                 relu=['relu', 'topk'], causal=[args.router, 'topk'], chars=['seqtopk', 'topk'])
    needs = {flag: routers for flag, routers in needs.items() if getattr(args, flag)}
    if not needs and not args.window_spend:
        parser.error("choose an analysis: --relu_schedule, --equal_compute, --relu, --causal, "
                     "--chars or --window_spend")
    if missing := [root for root in args.roots if not os.path.isdir(root)]:
        fail(f"no sweep folder {missing[0]}")
    for flag, router, k in ((f, r, k) for f, routers in needs.items() for r in routers for k in ks):
        if not runs_of(args.roots, router, k):
            fail(f"--{flag} reads {router}-k{k}-s* runs, but {', '.join(args.roots) or 'no folder'}"
                 f" holds no finished one; give the sweep folders that do, or other --top_ks")
    if (args.chars or args.causal) and not os.path.isdir(data_dir):
        fail(f"no data in {data_dir}/: give the --dataset the runs trained on")
    if args.relu_schedule:
        for k in ks:
            print(f"K={k}: --k_schedule={relu_schedule(args.roots, k)}")
    if args.equal_compute:
        markdown(['K', f"{args.router}: experts/token in training", 'in evaluation', 'val CE',
                  'Δ vs topk at K', 'topk K′ around its spend', 'Δ vs topk at its spend',
                  'Δ vs seqtopk at K'],
                 [[row['K'], f"{row['spend_train']:.3f}", f"{row['spend_eval']:.3f}",
                   row['val_ce'], format_difference(row['vs_topk']),
                   f"{row['between'][0]}, {row['between'][1]}",
                   format_difference(row['vs_topk_at_spend']) or "n/a: needs topk-k{} and "
                   "topk-k{} runs of its seeds".format(*row['between']),
                   format_difference(row['vs_seqtopk']) if row['vs_seqtopk'] else 'n/a']
                  for row in equal_compute(args.roots, args.router, ks)])
    if args.window_spend:
        window_spend()
    if args.relu:
        relu_table(args.roots, ks)
    if args.causal:
        markdown(['K', f"{args.router} routed", 'experts/token', 'val CE', 'Δ vs topk at K'])
        for k in ks:
            ce, spend, topk, gap = routed_ways(args.roots, args.router, k, args.batches, data_dir)
            own, *labels = ROUTED.get(args.router, ('own', f"as {args.router} evaluates", "as "
                                      "topk", "online (it has no online rule: as it evaluates)"))
            for way, label in zip(WAYS, labels):
                print(f"| {k} | {label} | {spend[way]:.3f} | {mean_std(ce[way].values())[0]} | "
                      f"{format_difference(paired_difference(ce[way], topk))} |")
            print(f"| {k} | online − {own}, paired | | | "
                  f"{format_difference(paired_difference(ce['online'], ce['own']))} |")
            print(f"(K={k}: {len(ce['own'])} seeds, {args.batches} val batches, topk's runs on "
                  f"the same batches; the {own}'s CE is each run's logged val CE to {gap:.1e})")
    if args.chars:
        for k in ks:
            results = chars(args.roots, k, args.batches, data_dir)
            print_chars(results, k, args.batches)
            if args.out_dir:
                path = save_figure(chars_figure(results, k), args.out_dir, f'chars_k{k}.png')
                print(f"wrote {path}")
                with open(os.path.join(args.out_dir, f'chars_k{k}.json'), 'w') as f:
                    json.dump(results, f)


if __name__ == '__main__':
    main()
