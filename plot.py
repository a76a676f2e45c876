"""
The paper's routing figures, from the metrics logs of finished runs (nothing is re-run).

    python plot.py out-topk out-seqtopk                   # PNGs into the runs' common parent folder
    python plot.py sweeps/cpu/topk-k2-s1 sweeps/cpu/seqtopk-k2-s1 --out=sweeps/cpu

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

import matplotlib
matplotlib.use('Agg')  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def load_run(out_dir):
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        raise SystemExit(f"error: no log.jsonl in {out_dir}; give the out_dir of a train.py run")
    records = [json.loads(line) for line in open(path)]
    evals = [r for r in records if r.get('event') == 'eval']
    if not evals:
        raise SystemExit(f"error: {path} has no eval records yet")
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
        cvs = [sum(l['load_cv'] for l in e['layers']) / len(e['layers']) for e in run['evals']]
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
        hist = [sum(col) for col in zip(*(l['experts_hist'] for l in run['final']['layers']))]
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('runs', nargs='+', help="out_dirs of train.py runs")
    parser.add_argument('--out', default=None, help="folder for the PNGs (default: the runs' common parent)")
    args = parser.parse_args(argv)
    runs = [load_run(d) for d in args.runs]
    # one run: its own folder; several: the folder they share (e.g. the sweep's out_root)
    out = args.out or (args.runs[0] if len(args.runs) == 1 else
                       os.path.commonpath([os.path.abspath(d) for d in args.runs]))
    for path in plot_all(runs, out):
        print(f"wrote {path}")


if __name__ == '__main__':
    main()
