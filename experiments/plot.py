"""
The paper's routing figures from finished runs' logs (nothing is re-run), and the pictures that
explain routing (the walkthrough's and the README's). PNGs go to --out_dir, never into the runs.

    python experiments/plot.py out-topk out-seqtopk  # routing figures: load_variance.png,
        # entropy_per_layer.png, experts_histogram.png (Fig. 4a-c), experts_by_entropy.png
        # (Fig. 5a), experts_by_position.png (online SeqTopK's banked budget)
    python experiments/plot.py --sweep=sweeps/cpu/sweep.json  # paired_difference.png, and the
        # routing figures of the sweep's trained runs at its smallest K, first seed
    python experiments/plot.py --explain [runs]  # selection, batch, online; with runs tokens.png
    python experiments/plot.py --bench=results/bench.json  # decoding.png: bench.py's speeds
    python experiments/plot.py --curves sweeps/plateau/*-s[0-9]  # train_curves.png; prints each
        # run's first step logged below --escape (below the bigram plateau)
"""
import itertools
import json
import os
import re
import sys

import matplotlib
import torch

if __name__ == '__main__':
    matplotlib.use('Agg')  # files only, no display (imported, e.g. by the walkthrough: its own)
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configurator import arg_parser, fail
from router import batchtopk_mask, online_seqtopk_mask, seqtopk_mask, topk_mask
from checkpoint import read_run
from stats import layer_mean, summed_histogram


def save_figure(fig, out, name):  # the one way a picture is written: 120 dpi, closed
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    fig.savefig(path, dpi=120, bbox_inches='tight')
    plt.close(fig)
    return path


def figure(title, xlabel, ylabel):
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def finish(fig, ax):
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return fig


def side_by_side(ax, i, n, heights, **kwargs):
    """The i-th of n bar series, each bar beside the others' at x = 0, 1, ..."""
    width = 0.8 / n
    ax.bar([x + (i - (n - 1) / 2) * width for x in range(len(heights))], heights, width=width,
           **kwargs)


# -----------------------------------------------------------------------------
# the paper's routing figures, from runs' logs

def load_run(out_dir):
    log = read_run(out_dir)
    if log is None:
        fail(f"no log.jsonl in {out_dir}; give the out_dir of a train.py run")
    if not log['eval']:
        fail(f"{out_dir}/log.jsonl has no eval records yet")
    if not log['eval'][-1].get('layers'):
        fail(f"{out_dir} is a dense run (no MoE layers): it has no routing to plot")
    args = (log['start'] or [{}])[0].get('model_args', {})
    router = args.get('router', os.path.basename(out_dir.rstrip('/')))
    return dict(label=f"{router} K={args.get('top_k', '?')}", evals=log['eval'],
                final=log['eval'][-1])


def routing_figures(runs):
    """{name: figure} of the routing figures for runs (load_run's)."""
    figures = {}
    fig, ax = figure('Expert load over training', 'iteration',
                     'load coefficient of variation (mean over layers)')
    for run in runs:
        ax.plot([e['iter'] for e in run['evals']],
                [layer_mean(e['layers'], 'load_cv') for e in run['evals']], marker='o',
                label=run['label'])
    figures['load_variance.png'] = finish(fig, ax)
    fig, ax = figure('Routing entropy per layer (final eval)', 'MoE layer',
                     'normalised entropy (1 = balanced)')
    for run in runs:
        entropy = [layer['entropy'] for layer in run['final']['layers']]
        ax.plot(range(len(entropy)), entropy, marker='o', label=run['label'])
    figures['entropy_per_layer.png'] = finish(fig, ax)
    fig, ax = figure('Experts per token (final eval, all MoE layers)', 'experts per token',
                     'share of tokens')
    for i, run in enumerate(runs):
        hist = summed_histogram(run['final']['layers'])
        side_by_side(ax, i, len(runs), [h / (sum(hist) or 1) for h in hist], label=run['label'])
    figures['experts_histogram.png'] = finish(fig, ax)
    fig, ax = figure('Experts per token by position (final eval)', 'position in the sequence',
                     'mean experts per token')
    for run in runs:
        final = run['final']
        if 'val_causal_experts_by_position' in final:  # seqtopk: online (causal) and offline
            ax.plot(final['val_causal_experts_by_position'], label=run['label'] + ' online')
            ax.plot(final['val_offline_experts_by_position'], label=run['label'] + ' offline',
                    alpha=0.6)
        else:
            ax.plot(final['val_experts_by_position'], label=run['label'])
    figures['experts_by_position.png'] = finish(fig, ax)
    fig, ax = figure('Experts per token vs predictive entropy (final eval)',
                     'predictive entropy H / log V', 'mean experts per token')
    for run in runs:
        experts = run['final']['val_experts_by_entropy']
        bins = [i for i, n in enumerate(run['final']['val_tokens_by_entropy']) if n]  # not empty
        ax.plot([(i + 0.5) / len(experts) for i in bins], [experts[i] for i in bins], marker='o',
                label=run['label'])
    figures['experts_by_entropy.png'] = finish(fig, ax)
    return figures


def train_curves(dirs, escape):
    """Training CE per seed, a colour per row; and per run a line: its first step below escape."""
    fig, ax = figure('Training CE per seed', 'step', 'training cross-entropy (nats)')
    colours, lines = {}, []
    for out_dir in sorted(dirs):
        log = read_run(out_dir)
        if log is None:
            fail(f"no log.jsonl in {out_dir}; give the out_dir of a train.py run")
        steps, ce = [r['iter'] for r in log['train']], [r['ce'] for r in log['train']]
        name = os.path.basename(os.path.normpath(out_dir))
        row = re.sub(r'-s\d+$', '', name)
        new = row not in colours
        colour = colours.setdefault(row, f'C{len(colours) % 10}')
        ax.plot(steps, ce, color=colour, lw=1, label=row if new else None)
        below = next((s for s, c in zip(steps, ce) if c < escape), None)
        lines.append(f"{name}: below {escape} from step {below if below is not None else 'never'}, "
                     f"last logged CE {ce[-1]:.4f}" if ce else f"{name}: no training records")
    ax.axhline(escape, color='gray', ls=':', lw=1)
    ax.set_ylim(top=3.0)
    return finish(fig, ax), lines


def paired_differences(sweep):
    """Paired difference from topk vs K, one panel per kind of row (trained, training-free)."""
    rows = [r for r in sweep['rows']
            if r['router'] not in ('topk', 'dense') and r['diff_vs_topk'] is not None]
    kinds = [kind for kind in ('train', 'training-free') if any(r['kind'] == kind for r in rows)]
    if not kinds:
        fail("the sweep has no router besides topk to compare")
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False,
                             sharey=True)
    series, seeds = sorted({r['router'] for r in rows}), max(r['diff_n'] for r in rows)
    for ax, kind in zip(axes[0], kinds):
        title = 'training-free' if kind != 'train' else (
            'fine-tuned' if sweep.get('finetune') else 'pretrained')
        ax.set_title(f"{title}: val CE minus topk's, same seed")
        ax.axhline(0, color='black', lw=0.8)
        for i, router in enumerate(series):
            picked = sorted((r for r in rows if r['router'] == router and r['kind'] == kind),
                            key=lambda r: r['K'])
            for causal in (False, True):  # the routers without an online rule route causally
                if not picked or causal and router.split('+')[0] not in ('seqtopk', 'windowtopk'):
                    continue
                key = 'diff_causal' if causal else 'diff'
                mean, low = [r[f'{key}_vs_topk'] for r in picked], [r[f'{key}_low'] for r in picked]
                errors = None if None in low else [
                    [m - lo for m, lo in zip(mean, low)],
                    [r[f'{key}_high'] - m for r, m in zip(picked, mean)]]
                shift = 1 + 0.04 * (2 * i + causal - len(series))  # side by side around each K
                ax.errorbar([r['K'] * shift for r in picked], mean, yerr=errors, marker='o',
                            capsize=3, color=f'C{i}', ls='--' if causal else '-',
                            label=router + (' (causal routing)' if causal else ''))
        ks = sorted({r['K'] for r in rows})
        ax.set_xscale('log', base=2)
        ax.set(xlim=(ks[0] / 1.6, ks[-1] * 1.6), xlabel='K (experts per token)')
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel('Δ val cross-entropy vs topk (nats)' + (
        f'\nmean over {seeds} seeds, 95% t-interval' if seeds > 1 else '\n1 seed: no interval'))
    return fig


def decoding(bench):
    """bench.py's decoding: tokens/s of each router, full recompute and each cached way."""
    decode = bench['decode']
    fig, ax = figure(f"Decoding {decode[0]['new_tokens']} tokens, {bench['device']}, "
                     f"{bench['dtype']}", 'router', 'tokens / s')
    routers = list(dict.fromkeys(r['router'] for r in decode))
    ways = [way for way in dict.fromkeys(r['way'] for r in decode)  # those every router ran
            if all(any(r['router'] == router and r['way'] == way for r in decode)
                   for router in routers)]
    bars = [('full recompute', 'recompute_tok_s', 'eager')] + [
        (f'KV + Expert Cache, {way}', 'cached_tok_s', way) for way in ways]
    for i, (label, key, way) in enumerate(bars):
        speeds = [next(r[key] for r in decode if r['router'] == router and r['way'] == way)
                  for router in routers]
        side_by_side(ax, i, len(bars), speeds, label=label)
    ax.set_xticks(range(len(routers)), routers)
    ax.margins(y=0.3)  # headroom above the bars for the legend
    return finish(fig, ax)


def sweep_runs(sweep, folder):
    """The folders of the sweep's trained runs at its smallest K, first seed; each must still be
    the run its table was made from."""
    trained = [r for r in sweep['runs'] if r.get('kind') == 'train']
    if not trained:
        return []
    k, seed = min(r['top_k'] for r in trained), min(r['seed'] for r in trained)
    chosen = [r for r in trained if r['top_k'] == k and r['seed'] == seed]
    for r in chosen:
        log = read_run(os.path.join(folder, r['name']))
        done = log['done'] if log else []
        if r.get('run_id') and (not done or done[-1].get('run_id') != r['run_id']):
            fail(f"{os.path.join(folder, r['name'])} is not the run its sweep.json was made from "
                 f"(it was trained again since); run the sweep's command again to write a "
                 f"sweep.json of the runs there now")
    return [os.path.join(folder, r['name']) for r in chosen]


# -----------------------------------------------------------------------------
# how routing works: the pictures of the walkthrough and the README

def example_scores(B=1, T=8, N=8, seed=10):
    """Router scores (B, T, N) as a trained router gives them, some tokens sure of their experts
    and some unsure: each token's logits at its own temperature."""
    g = torch.Generator().manual_seed(seed)
    sharpness = torch.rand(B, T, 1, generator=g) * 2.5 + 0.3
    return (torch.randn(B, T, N, generator=g) * sharpness).softmax(-1)


def selection_figure(scores, masks, titles, rows_per_sequence=None):
    """Selections (masks) of scores (T, N) side by side, the taken entries boxed, each row's count
    at its right; a batch stacked has a line between sequences every rows_per_sequence rows."""
    T, N = scores.shape
    per = rows_per_sequence or T
    fig, axes = plt.subplots(1, len(masks), figsize=(3.2 * len(masks), 0.42 * T + 1.9),
                             sharey=True, squeeze=False)
    for ax, mask, title in zip(axes[0], masks, titles):
        ax.imshow(scores.numpy(), cmap='Blues', vmin=0, vmax=float(scores.max()) * 1.25,
                  aspect='auto')
        for t in range(T):
            for i in range(N):
                ax.text(i, t, f"{float(scores[t, i]):.2f}"[1:], ha='center', va='center',
                        fontsize=6, color='white' if scores[t, i] > 0.6 * scores.max() else 'black')
            ax.text(N - 0.3, t, f"{int(mask[t].sum())}", va='center', fontsize=9, weight='bold')
        for t, i in mask.nonzero().tolist():
            ax.add_patch(Rectangle((i - 0.5, t - 0.5), 1, 1, fill=False, edgecolor='crimson', lw=2))
        for edge in range(per, T, per):
            ax.axhline(edge - 0.5, color='black', lw=2)
        totals = [int(mask[s:s + per].sum()) for s in range(0, T, per)]
        ax.set_title(f"{title}\n{'sequence totals' if len(totals) > 1 else 'total'}: "
                     f"{', '.join(map(str, totals))} experts", fontsize=10)
        ax.set_xticks(range(N))
        ax.set_xlabel('expert (bold at the right: experts per token)', fontsize=8)
    axes[0][0].set_yticks(range(T), [str(t % per + 1) for t in range(T)])
    axes[0][0].set_ylabel('token')
    fig.tight_layout()
    return fig


def spend_figure(masks, labels, k):
    """Experts the first m tokens took, against the budget m*K, for each mask (T, N)."""
    fig, ax = figure("Experts spent by tokens 1..m", "m (tokens so far)", "experts")
    m = torch.arange(1, masks[0].shape[0] + 1)
    ax.plot(m, m * k, color='0.75', lw=7, zorder=0, label=f'budget m·K (K={k})')  # under all
    for mask, label, style in zip(masks, labels, ('o-', 's--', '^:')):
        ax.plot(m, mask.sum(-1).cumsum(0), style, label=label)
    return finish(fig, ax)


def explain_selections(scores, k):
    """TopK's and SeqTopK's selections of scores (B, T, N), and for B > 1 BatchTopK's."""
    B, T, N = scores.shape
    masks = [topk_mask(scores, k), seqtopk_mask(scores, k)] + [batchtopk_mask(scores, k)] * (B > 1)
    titles = [f"TopK: each token its top K = {k}", f"SeqTopK: the sequence's top T·K = {T * k},\n"
              f"each token 1 to K+2 = {k + 2}", f"BatchTopK: the batch's top B·T·K = {B * T * k}"]
    return selection_figure(scores.reshape(B * T, N), [m.reshape(B * T, N) for m in masks],
                            titles, rows_per_sequence=T)


def layout(tokens, width):
    """(x, row, cells) of each token's box: as many cells as its characters, rows of width."""
    places, x, row = [], 0, 0
    for token in tokens:
        cells = max(1, len(token))
        if x + cells > width:
            x, row = 0, row + 1
        places.append((x, row, cells))
        x += cells
    return places


def token_figure(texts, counts, top_ks, titles, width=40):
    """Per sample its tokens' strings (texts) on backgrounds coloured by the experts each took
    (counts: (layers, tokens)), as sample.shade of its own K (top_ks): blue fewer than K, grey K,
    red more."""
    from sample import shade
    cmap = plt.get_cmap('coolwarm')
    colour = lambda n, k: cmap(0.5 + 0.5 * shade(int(n), k))
    shown = [[token.replace('\n', '⏎').replace(' ', '·')[:width] for token in text]
             for text in texts]
    places = [layout(text, width) for text in shown]  # a word piece as wide as its text
    rows = [place[-1][1] + 1 if place else 0 for place in places]
    fig, ax = plt.subplots(figsize=(width * 0.2 + 1, 4))
    row = 0
    for text, place, count, k, title, n_rows in zip(shown, places, counts, top_ks, titles, rows):
        ax.text(0, row, title, fontsize=10, weight='bold', va='center')
        row += 1
        # consecutive layers that gave every token the same count: one block
        for taken, block in itertools.groupby(enumerate(torch.as_tensor(count).tolist()),
                                              key=lambda layer: layer[1]):
            group = [layer for layer, _ in block]
            name = f"layer {group[0]}" if len(group) == 1 else f"layers {group[0]}-{group[-1]}"
            ax.text(-1, row, name, fontsize=7, va='center', ha='right')
            for token, (x, y, cells), n in zip(text, place, taken):
                ax.add_patch(Rectangle((x - 0.5, row + y - 0.5), cells, 1, color=colour(n, k)))
                ax.text(x - 0.5 + cells / 2, row + y, token, ha='center', va='center', fontsize=8,
                        family='monospace')
            row += n_rows + 1
    ax.set_xlim(-5, width)
    ax.set_ylim(row, -1)
    fig.set_figheight(row * 0.3 + 0.4)
    ax.axis('off')
    if len(set(top_ks)) == 1:  # every count from the fewest taken (relu's 0) to K+2
        k = top_ks[0]
        fewest = min(1, *(int(torch.as_tensor(count).min()) for count in counts))
        keys = [(colour(n, k), f"{n} expert{'s' * (n != 1)}") for n in range(fewest, k + 3)]
    else:  # several K: the shades' meaning (each panel's title gives its K)
        keys = [(cmap(0.5 + 0.5 * f), name) for f, name in (
            (-0.5, 'fewer than K'), (0, 'K'), (0.5, 'more than K'))]
    ax.legend([Rectangle((0, 0), 1, 1, color=c) for c, _ in keys], [name for _, name in keys],
              ncol=len(keys), loc='lower center', bbox_to_anchor=(0.5, 1.0), fontsize=8,
              frameon=False)
    fig.tight_layout()
    return fig


def sample_routing(out_dir, prompt, new_tokens, seed=0):
    """A sample of the checkpoint in out_dir (its tokens' strings), the experts each took
    (layers, tokens) in eager generation, and the model's config."""
    from prepare import get_codec
    from sample import ExpertCounts, generate, load_model
    model, meta = load_model(out_dir, 'cpu')
    if not model.routers():
        fail(f"{out_dir} holds a dense GPT (no MoE layer): its tokens take no experts to colour")
    encode, decode = get_codec(meta)
    try:
        start = encode(prompt)
    except ValueError:  # a vocabulary without those characters: its first token instead
        start = [0]
        print(f"note: {out_dir}'s vocabulary cannot spell {prompt!r}; its sample starts from "
              f"{decode(start)!r}")
    torch.manual_seed(seed)
    counts = ExpertCounts()
    ids = generate(model, torch.tensor([start]), new_tokens, temperature=0.8,
                   sample_top_k=50, on_token=counts.add)[0].tolist()
    per_layer = counts.per_layer()  # every token but the last went through the layers
    return [decode([i]) for i in ids[:per_layer.shape[1]]], per_layer, model.config


def explain(runs=(), prompt='ROMEO:', new_tokens=120):
    """{name: figure}: selection.png, batch.png, online.png and (with runs) tokens.png."""
    k, one = 2, example_scores()
    offline, online = seqtopk_mask(one, k)[0], online_seqtopk_mask(one, k)[0][0]
    figures = {'selection.png': explain_selections(one, k),
               'batch.png': explain_selections(example_scores(B=2, seed=3), k),
               'online.png': selection_figure(one[0], [offline, online], [
                   "SeqTopK: the whole sequence at once",
                   "online SeqTopK: token m against the\nExpert Cache of tokens 1..m-1"])}
    if runs:
        texts, counts, configs = zip(*(sample_routing(run, prompt, new_tokens) for run in runs))
        figures['tokens.png'] = token_figure(texts, counts, [c.top_k for c in configs], [
            f"{c.router}, K={c.top_k}: experts per token in each layer" for c in configs])
    return figures


def read_json(path, needs, made_by):
    """The results file at path, holding `needs` (bench.json's decode, sweep.json's rows)."""
    if not os.path.isfile(path):
        fail(f"no {path}; run {made_by} first")
    try:
        results = json.load(open(path, encoding='utf-8'))
    except ValueError:  # not JSON, or not UTF-8
        results = None
    if not isinstance(results, dict) or not results.get(needs):
        fail(f"{path} holds no {needs} results; give the file {made_by} writes")
    return results


def main(argv=None):
    parser = arg_parser(__doc__)
    parser.add_argument('runs', nargs='*', help="out_dirs of train.py runs")
    parser.add_argument('--sweep', help="a sweep.json: its paired-difference and routing figures")
    parser.add_argument('--bench', help="a bench.json: its decoding figure")
    parser.add_argument('--curves', action='store_true', help="the runs' training CE per seed")
    parser.add_argument('--explain', action='store_true', help="pictures of how routing works "
                        "(with runs: their text coloured by experts per token)")
    parser.add_argument('--escape', type=float, default=2.3,
                        help="--curves: the CE a run's step is found below")
    parser.add_argument('--out_dir', help="the folder for the PNGs (default: figures, with "
                        "--explain results/explain)")
    args = parser.parse_args(argv)
    out, figures = args.out_dir or ('results/explain' if args.explain else 'figures'), {}
    if args.explain:
        figures = explain(args.runs)
    elif args.bench:
        bench = read_json(args.bench, 'decode', f"`python bench.py --what=decode "
                          f"--out_dir={os.path.dirname(args.bench) or '.'}`")
        figures = {'decoding.png': decoding(bench)}
    elif args.curves:
        figures['train_curves.png'], lines = train_curves(args.runs, args.escape)
        print('\n'.join(lines))
    else:
        if args.sweep:
            sweep = read_json(args.sweep, 'rows', 'experiments/sweep.py')
            figures['paired_difference.png'] = paired_differences(sweep)
            args.runs = args.runs or sweep_runs(sweep, os.path.dirname(os.path.abspath(args.sweep)))
        elif not args.runs:
            parser.error("give out_dirs of train.py runs, or --sweep=sweep.json")
        if args.runs:
            figures.update(routing_figures([load_run(d) for d in args.runs]))
    for name, fig in figures.items():
        print(f"wrote {save_figure(fig, out, name)}")


if __name__ == '__main__':
    main()
