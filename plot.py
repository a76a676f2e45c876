"""
The paper's routing figures, from the metrics logs of finished runs (nothing is re-run), and the
pictures that explain routing (the walkthrough's and the README's).

    python plot.py --explain --out=results/explain        # TopK vs SeqTopK vs BatchTopK, the Expert Cache
    python plot.py --explain out-topk out-seqtopk          # and text coloured by the experts each token took
    python plot.py out-topk out-seqtopk                   # PNGs into the runs' common parent folder
    python plot.py sweeps/cpu/topk-k2-s1 sweeps/cpu/seqtopk-k2-s1 --out=sweeps/cpu
    python plot.py --sweep=sweeps/finetune_cpu/sweep.json # the sweep's figures, next to its sweep.json
    python plot.py --bench=results/bench-cpu.json         # decoding.png: bench.py's decoding speeds
    python plot.py --curves sweeps/plateau/*-s[0-9]       # train_curves.png: training CE per seed

With --sweep (the sweep.json written by sweep.py):
  paired_difference.png     every router's paired val-CE difference from topk vs K, mean over seeds
                            with the 95% t-interval as error bars; fine-tuned (or pretrained) and
                            training-free panels; dense rows are in the table, not here
and the routing figures below for the sweep's trained runs at its smallest K, first seed, every router.

With --explain (pictures of how routing works, on example scores; with runs, their generated text):
  selection.png             one sequence's scores, TopK's and SeqTopK's selections side by side
  batch.png                 two sequences' scores, TopK's, SeqTopK's and BatchTopK's selections
  online.png                online SeqTopK token by token against the Expert Cache, beside SeqTopK
  tokens.png                each run's sample, every token coloured by the experts it took, per layer

With --curves (any runs, dense ones too):
  train_curves.png          training CE against step, a colour per row (run name without -s<seed>),
                            a line per seed; prints the step at which each run first logs CE below
                            --escape (default 2.3: below the bigram plateau, about 2.47 on Shakespeare)

Writes, for the runs given (each an out_dir holding log.jsonl):
  load_variance.png         expert-load coefficient of variation over training (paper Fig. 4a)
  entropy_per_layer.png     normalised routing entropy of each MoE layer, final eval (Fig. 4b)
  experts_histogram.png     how many experts tokens took, final eval (Fig. 4c)
  experts_by_position.png   mean experts per token at each position: online SeqTopK "banks" budget
  experts_by_entropy.png    mean experts per token vs the token's predictive entropy (Fig. 5a)
"""
import argparse
import json
import os
import re

import matplotlib
import torch

if __name__ == '__main__':
    matplotlib.use('Agg')  # files only, no display (imported, e.g. by the walkthrough: its own)
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from checkpoint import read_log  # noqa: E402
from router import batchtopk_mask, online_seqtopk_mask, seqtopk_mask, topk_mask  # noqa: E402
from stats import layer_mean, summed_histogram  # noqa: E402


def load_run(out_dir):
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        raise SystemExit(f"error: no log.jsonl in {out_dir}; give the out_dir of a train.py run")
    records = read_log(path)  # skips (and says so) a line cut off mid-write
    evals = [r for r in records if r.get('event') == 'eval']
    if not evals:
        raise SystemExit(f"error: {path} has no eval records yet")
    if not evals[-1].get('layers'):
        raise SystemExit(f"error: {out_dir} is a dense run (no MoE layers): it has no routing to plot")
    start = next((r for r in records if r.get('event') == 'start'), {})
    args = start.get('model_args', {})
    label = f"{args.get('router', os.path.basename(out_dir.rstrip('/')))} K={args.get('top_k', '?')}"
    return dict(label=label, evals=evals, final=evals[-1], n_exp=args.get('n_exp'))


def figure(title, xlabel, ylabel):
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return fig, ax


def save(fig, ax, out, name):
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    path = os.path.join(out, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(runs, out):
    os.makedirs(out, exist_ok=True)
    written = []

    fig, ax = figure('Expert load over training', 'iteration', 'load coefficient of variation (mean over layers)')
    for run in runs:
        its = [e['iter'] for e in run['evals']]
        cvs = [layer_mean(e['layers'], 'load_cv') for e in run['evals']]
        ax.plot(its, cvs, marker='o', label=run['label'])
    written.append(save(fig, ax, out, 'load_variance.png'))

    fig, ax = figure('Routing entropy per layer (final eval)', 'MoE layer', 'normalised entropy (1 = balanced)')
    for run in runs:
        entropy = [l['entropy'] for l in run['final']['layers']]
        ax.plot(range(len(entropy)), entropy, marker='o', label=run['label'])
    written.append(save(fig, ax, out, 'entropy_per_layer.png'))

    fig, ax = figure('Experts per token (final eval, all MoE layers)', 'experts per token', 'share of tokens')
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        hist = summed_histogram(run['final']['layers'])
        total = sum(hist) or 1
        offset = (i - (len(runs) - 1) / 2) * width  # bars of the runs side by side around each count
        ax.bar([c + offset for c in range(len(hist))], [h / total for h in hist], width=width, label=run['label'])
    written.append(save(fig, ax, out, 'experts_histogram.png'))

    fig, ax = figure('Experts per token by position (final eval)', 'position in the sequence', 'mean experts per token')
    for run in runs:
        final = run['final']
        if 'val_causal_experts_by_position' in final:  # seqtopk: online (causal) and offline routing
            ax.plot(final['val_causal_experts_by_position'], label=run['label'] + ' online')
            ax.plot(final['val_offline_experts_by_position'], label=run['label'] + ' offline', alpha=0.6)
        else:
            ax.plot(final['val_experts_by_position'], label=run['label'])
    written.append(save(fig, ax, out, 'experts_by_position.png'))

    fig, ax = figure('Experts per token vs predictive entropy (final eval)', 'predictive entropy H / log V',
                     'mean experts per token')
    for run in runs:
        experts, counts = run['final']['val_experts_by_entropy'], run['final']['val_tokens_by_entropy']
        centers = [(i + 0.5) / len(experts) for i in range(len(experts))]
        points = [(c, e) for c, e, n in zip(centers, experts, counts) if n > 0]
        ax.plot([c for c, _ in points], [e for _, e in points], marker='o', label=run['label'])
    written.append(save(fig, ax, out, 'experts_by_entropy.png'))
    return written


def train_curve(out_dir):
    """(steps, training CEs) of a run's log.jsonl, dense or MoE."""
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        raise SystemExit(f"error: no log.jsonl in {out_dir}; give the out_dir of a train.py run")
    train = [r for r in read_log(path) if r.get('event') == 'train']
    return [r['iter'] for r in train], [r['ce'] for r in train]


def plot_train_curves(dirs, out, escape):
    """One colour per row (the run's name without -s<seed>), one line per seed; prints each run's
    first step below `escape`."""
    fig, ax = figure('Training CE per seed', 'step', 'training cross-entropy (nats)')
    colours, lines = {}, []
    for out_dir in sorted(dirs):
        name = os.path.basename(os.path.normpath(out_dir))
        row = re.sub(r'-s\d+$', '', name)
        colour = colours.setdefault(row, f'C{len(colours) % 10}')
        steps, ce = train_curve(out_dir)
        ax.plot(steps, ce, color=colour, lw=1, label=row if row not in ax.get_legend_handles_labels()[1]
                else None)
        below = next((s for s, c in zip(steps, ce) if c < escape), None)
        lines.append(f"{name}: below {escape} from step {below if below is not None else 'never'}, "
                     f"last logged CE {ce[-1]:.4f}" if ce else f"{name}: no training records")
    ax.axhline(escape, color='gray', ls=':', lw=1)
    ax.set_ylim(top=3.0)
    return save(fig, ax, out, 'train_curves.png'), lines


def plot_paired_differences(sweep, out):
    """Paired difference from topk vs K, one panel per kind of row (trained, training-free)."""
    rows = [r for r in sweep['rows'] if r['router'] not in ('topk', 'dense') and r['diff_vs_topk'] is not None]
    kinds = [kind for kind in ('train', 'training-free') if any(r['kind'] == kind for r in rows)]
    if not kinds:
        raise SystemExit("error: the sweep has no router besides topk to compare")
    fig, axes = plt.subplots(1, len(kinds), figsize=(6 * len(kinds), 4.2), squeeze=False, sharey=True)
    series = sorted({r['router'] for r in rows})
    seeds = max(r['diff_n'] for r in rows)
    for ax, kind in zip(axes[0], kinds):
        title = {'train': 'fine-tuned' if sweep.get('finetune') else 'pretrained', 'training-free': 'training-free'}
        ax.set_title(f"{title[kind]}: val CE minus topk's, same seed")
        ax.axhline(0, color='black', lw=0.8)
        for i, router in enumerate(series):
            for causal in (False, True):
                picked = sorted((r for r in rows if r['router'] == router and r['kind'] == kind), key=lambda r: r['K'])
                if not picked or (causal and router.split('+')[0] != 'seqtopk'):  # the others route causally anyway
                    continue
                key = 'diff_causal' if causal else 'diff'
                mean = [r[f'{key}_vs_topk'] for r in picked]
                low = [r[f'{key}_low'] for r in picked]
                errors = None if None in low else [[m - lo for m, lo in zip(mean, low)],
                                                  [r[f'{key}_high'] - m for r, m in zip(picked, mean)]]
                shift = 1 + 0.04 * (2 * i + causal - len(series))  # side by side around each K (log axis)
                ax.errorbar([r['K'] * shift for r in picked], mean, yerr=errors, marker='o', capsize=3, color=f'C{i}',
                            ls='--' if causal else '-', label=router + (' (causal routing)' if causal else ''))
        ks = sorted({r['K'] for r in rows})
        ax.set_xscale('log', base=2)
        ax.set_xlim(ks[0] / 1.6, ks[-1] * 1.6)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.set_xlabel('K (experts per token)')
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel('Δ val cross-entropy vs topk (nats)' + (
        f'\nmean over {seeds} seeds, 95% t-interval' if seeds > 1 else '\n1 seed: no interval'))
    fig.tight_layout()
    path = os.path.join(out, 'paired_difference.png')
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_decoding(bench, out):
    """bench.py's long-context decoding: tokens/s of each router and way (cache eager, cache compiled,
    full recompute), from its JSON."""
    fig, ax = figure(f"Decoding {bench['decode'][0]['new_tokens']} tokens, {bench['device']}, {bench['dtype']}",
                     'router', 'tokens / s')
    routers = list(dict.fromkeys(r['router'] for r in bench['decode']))
    ways = [way for way in dict.fromkeys(r['way'] for r in bench['decode'])  # those every router ran
            if all(any(r['router'] == router and r['way'] == way for r in bench['decode']) for router in routers)]
    bars = [('full recompute', lambda r: r['recompute_tok_s'], 'eager')] + [
        (f'KV + Expert Cache, {way}', lambda r: r['cached_tok_s'], way) for way in ways]
    for i, (label, value, way) in enumerate(bars):
        speeds = [next(value(r) for r in bench['decode'] if r['router'] == router and r['way'] == way)
                  for router in routers]
        ax.bar([j + (i - (len(bars) - 1) / 2) * 0.8 / len(bars) for j in range(len(routers))], speeds,
               width=0.8 / len(bars), label=label)
    ax.set_xticks(range(len(routers)), routers)
    ax.margins(y=0.3)  # headroom above the bars for the legend
    return save(fig, ax, out, 'decoding.png')


def sweep_runs(sweep, folder):
    """The out_dirs of the sweep's trained runs at its smallest K, first seed, one per router; each
    must still be the run the table was made from (a run trained again since: one line)."""
    trained = [r for r in sweep['runs'] if r.get('kind') == 'train']
    if not trained:
        return []
    k, seed = min(r['top_k'] for r in trained), min(r['seed'] for r in trained)
    chosen = [r for r in trained if r['top_k'] == k and r['seed'] == seed]
    for r in chosen:
        done = [x for x in read_log(os.path.join(folder, r['name'], 'log.jsonl')) if x.get('event') == 'done']
        if r.get('run_id') and (not done or done[-1].get('run_id') != r['run_id']):
            raise SystemExit(f"error: {os.path.join(folder, r['name'])} is not the run its sweep.json was "
                             f"made from (it was trained again since); run the sweep's command again to "
                             f"write a sweep.json of the runs there now")
    return [os.path.join(folder, r['name']) for r in chosen]


# -----------------------------------------------------------------------------
# how routing works: the pictures of the walkthrough and the README

def example_scores(B=1, T=8, N=8, seed=10):
    """Router scores (B, T, N) as a trained router gives them, some tokens sure of their experts
    and some unsure: each token's logits at its own temperature, then the softmax."""
    g = torch.Generator().manual_seed(seed)
    sharpness = torch.rand(B, T, 1, generator=g) * 2.5 + 0.3
    return (torch.randn(B, T, N, generator=g) * sharpness).softmax(-1)


def selection_figure(scores, masks, titles, rows_per_sequence=None):
    """Selections of the same scores (T, N) side by side: the scores as a heatmap with their values,
    the taken (token, expert) entries boxed, each token's expert count at the right of its row; a
    line between sequences every rows_per_sequence rows (a batch stacked)."""
    T, N = scores.shape
    fig, axes = plt.subplots(1, len(masks), figsize=(3.2 * len(masks), 0.42 * T + 1.6), sharey=True,
                             squeeze=False)
    for ax, mask, title in zip(axes[0], masks, titles):
        ax.imshow(scores, cmap='Blues', vmin=0, vmax=float(scores.max()) * 1.25, aspect='auto')
        for t in range(T):
            for i in range(N):
                ax.text(i, t, f"{float(scores[t, i]):.2f}"[1:], ha='center', va='center', fontsize=6,
                        color='white' if scores[t, i] > 0.6 * scores.max() else 'black')
            ax.text(N - 0.3, t, f"{int(mask[t].sum())}", va='center', fontsize=9, weight='bold')
        ax.text(N - 0.3, -0.8, 'experts', fontsize=7)
        for t, i in mask.nonzero().tolist():
            ax.add_patch(Rectangle((i - 0.5, t - 0.5), 1, 1, fill=False, edgecolor='crimson', lw=2))
        for edge in range(rows_per_sequence or T, T, rows_per_sequence or T):
            ax.axhline(edge - 0.5, color='black', lw=2)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(range(N))
        ax.set_xlabel('expert')
    axes[0][0].set_yticks(range(T), [str(t % (rows_per_sequence or T) + 1) for t in range(T)])
    axes[0][0].set_ylabel('token')
    fig.tight_layout()
    return fig


def spend_figure(masks, labels, k):
    """Experts the first m tokens took, against the budget m*k, for each mask (T, N)."""
    fig, ax = figure("Experts spent by tokens 1..m", "m (tokens so far)", "experts")
    T = masks[0].shape[0]
    m = torch.arange(1, T + 1)
    ax.plot(m, m * k, 'k--', label=f'budget m·K (K={k})')
    for mask, label in zip(masks, labels):
        ax.plot(m, mask.sum(-1).cumsum(0), marker='o', label=label)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def explain_selections(scores, k):
    """TopK's and SeqTopK's selections of the same scores (B, T, N), and for a batch (B > 1)
    BatchTopK's: the README's picture (one sequence) and the walkthrough's."""
    B, T, N = scores.shape
    masks = [topk_mask(scores, k), seqtopk_mask(scores, k)] + [batchtopk_mask(scores, k)] * (B > 1)
    titles = [f"TopK: each token its top K = {k}", f"SeqTopK: the sequence's top T·K = {T * k},\n"
              f"each token 1 to K+2 = {k + 2}", f"BatchTopK: the batch's top B·T·K = {B * T * k}"]
    return selection_figure(scores.reshape(B * T, N), [m.reshape(B * T, N) for m in masks],
                            titles, rows_per_sequence=T)


def token_figure(texts, counts, top_k, titles, width=40):
    """Texts, each token on a background coloured by the experts it took in each MoE layer (blue:
    fewer than top_k, white: top_k, red: more), a block of wrapped lines per layer. texts: per
    sample the tokens' strings; counts: per sample (layers, tokens)."""
    cmap = plt.get_cmap('coolwarm')
    colour = lambda n: cmap(0.5 + 0.5 * max(-1.0, min(1.0, (int(n) - top_k) / max(top_k, 1))))
    lines = [-(-len(text) // width) for text in texts]
    layers = [len(c) for c in counts]  # at most: identical layers share a block
    height = sum(n * (lines_ + 1) + 1 for n, lines_ in zip(layers, lines))
    fig, ax = plt.subplots(figsize=(width * 0.2 + 1, height * 0.3 + 0.4))
    row = 0
    for text, count, title, n_lines in zip(texts, counts, titles, lines):
        ax.text(0, row, title, fontsize=10, weight='bold', va='center')
        row += 1
        blocks = []  # consecutive layers that gave every token the same count: one block
        for layer, taken in enumerate(count):
            if blocks and torch.equal(torch.as_tensor(taken), torch.as_tensor(blocks[-1][1])):
                blocks[-1][0].append(layer)
            else:
                blocks.append(([layer], taken))
        for group, taken in blocks:
            name = f"layer {group[0]}" if len(group) == 1 else f"layers {group[0]}-{group[-1]}"
            ax.text(-1, row, name, fontsize=7, va='center', ha='right')
            for j, (token, n) in enumerate(zip(text, taken)):
                x, y = j % width, row + j // width
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, color=colour(n)))
                shown = {'\n': '⏎', ' ': '·'}.get(token, token)[:2]
                ax.text(x, y, shown, ha='center', va='center', fontsize=8, family='monospace')
            row += n_lines + 1
    ax.set_xlim(-5, width)
    ax.set_ylim(row, -1)
    fig.set_figheight(row * 0.3 + 0.4)
    ax.axis('off')
    legend = [Rectangle((0, 0), 1, 1, color=colour(n)) for n in range(1, top_k + 3)]
    ax.legend(legend, [f"{n} expert{'s' * (n > 1)}" for n in range(1, top_k + 3)], ncol=top_k + 2,
              loc='lower center', bbox_to_anchor=(0.5, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def sample_routing(out_dir, prompt, new_tokens, seed=0):
    """A sample of the checkpoint in out_dir (its tokens' strings) and, per MoE layer, the experts
    each token took (layers, tokens): eager generation, the plain definitions."""
    from prepare import get_codec
    from sample import ExpertCounts, load_model
    model, meta = load_model(out_dir, 'cpu')
    encode, decode = get_codec(meta)
    torch.manual_seed(seed)
    counts = ExpertCounts()
    ids = model.generate(torch.tensor([encode(prompt)]), new_tokens, temperature=0.8,
                         sample_top_k=50, on_token=counts.add)[0].tolist()
    per_layer = counts.per_layer()  # every token but the last went through the layers
    return [decode([i]) for i in ids[:per_layer.shape[1]]], per_layer, model.config


def plot_explain(out, runs=(), prompt='ROMEO:', new_tokens=120):
    """selection.png, online.png and (with runs) tokens.png into out."""
    os.makedirs(out, exist_ok=True)
    k, one = 2, example_scores()
    paths = [save_figure(explain_selections(one, k), out, 'selection.png'),
             save_figure(explain_selections(example_scores(B=2, seed=3), k), out, 'batch.png')]
    offline, online = seqtopk_mask(one, k)[0], online_seqtopk_mask(one, k)[0]
    paths.append(save_figure(selection_figure(one[0], [offline, online], [
        "SeqTopK: the whole sequence at once", "online SeqTopK: token m against the\nExpert Cache "
        "of tokens 1..m-1"]), out, 'online.png'))
    if runs:
        samples = [sample_routing(run, prompt, new_tokens) for run in runs]
        top_k = samples[0][2].top_k
        paths.append(save_figure(token_figure(
            [s[0] for s in samples], [s[1] for s in samples], top_k,
            [f"{s[2].router}, K={s[2].top_k}: experts per token in each layer" for s in samples]),
            out, 'tokens.png'))
    return paths


def save_figure(fig, out, name):
    path = os.path.join(out, name)
    fig.savefig(path, dpi=120, bbox_inches='tight')
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('runs', nargs='*', help="out_dirs of train.py runs")
    parser.add_argument('--sweep', default=None, help="a sweep.json: its paired-difference and routing figures")
    parser.add_argument('--bench', default=None, help="a bench.py JSON: its decoding figure")
    parser.add_argument('--curves', action='store_true', help="the runs' training CE per seed")
    parser.add_argument('--explain', action='store_true', help="pictures of how routing works "
                        "(with runs: their text coloured by experts per token)")
    parser.add_argument('--escape', type=float, default=2.3, help="--curves: the CE a run's step is found below")
    parser.add_argument('--out', default=None, help="folder for the PNGs (default: the runs' common parent)")
    args = parser.parse_args(argv)
    if args.explain:
        for path in plot_explain(args.out or 'results/explain', args.runs):
            print(f"wrote {path}")
        return
    if args.bench:
        if not os.path.exists(args.bench):
            raise SystemExit(f"error: no {args.bench}; run `python bench.py --json_out={args.bench}` first")
        out = args.out or os.path.dirname(args.bench) or '.'
        os.makedirs(out, exist_ok=True)
        print(f"wrote {plot_decoding(json.load(open(args.bench)), out)}")
        return
    if args.sweep:
        if not os.path.exists(args.sweep):
            raise SystemExit(f"error: no {args.sweep}; run sweep.py first")
        sweep = json.load(open(args.sweep))
        folder = os.path.dirname(os.path.abspath(args.sweep))
        out = args.out or folder
        os.makedirs(out, exist_ok=True)
        print(f"wrote {plot_paired_differences(sweep, out)}")
        args.runs = args.runs or sweep_runs(sweep, folder)
        args.out = out
        if not args.runs:
            return
    if not args.runs:
        parser.error("give out_dirs of train.py runs, or --sweep=sweep.json")
    if args.curves:
        out = args.out or os.path.commonpath([os.path.abspath(d) for d in args.runs])
        os.makedirs(out, exist_ok=True)
        path, lines = plot_train_curves(args.runs, out, args.escape)
        print('\n'.join(lines) + f"\nwrote {path}")
        return
    runs = [load_run(d) for d in args.runs]
    # one run: its own folder; several: the folder they share (e.g. the sweep's out_root)
    out = args.out or (args.runs[0] if len(args.runs) == 1 else
                       os.path.commonpath([os.path.abspath(d) for d in args.runs]))
    for path in plot_all(runs, out):
        print(f"wrote {path}")


if __name__ == '__main__':
    main()
