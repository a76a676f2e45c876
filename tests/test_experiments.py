"""
The experiment tools as tests: paired statistics, sweeps with dense rows, the sweep figures.
Run: python -m pytest -q
"""
import contextlib
import glob
import json
import math
import os
import re

import pytest

# the scripts as subprocesses, offline, one thread (or in this process, up to their exit)
from conftest import HANG, REPO, TINY, exit_message, one_error_line, run, sweep


# -----------------------------------------------------------------------------
# statistics

@pytest.mark.parametrize("df,expected",
                         [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042)])
def test_t_quantiles_match_the_printed_tables(df, expected):
    from compare import t_quantile
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-3)


def test_paired_difference_matches_a_hand_computation():
    from compare import paired_difference
    router = {1: 1.00, 2: 1.10, 3: 0.95, 4: 2.0}  # seed 4 has no topk partner: left out
    topk = {1: 0.90, 2: 1.05, 3: 0.95}
    # differences 0.10, 0.05, 0.00: mean 0.05, sample sd 0.05, se 0.05 / sqrt(3);
    # t(0.975, 2) = 4.3027
    half = 4.302653 * 0.05 / math.sqrt(3)
    d = paired_difference(router, topk)
    assert d['n'] == 3 and d['mean'] == pytest.approx(0.05)
    assert (d['low'] == pytest.approx(0.05 - half, abs=1e-5)
            and d['high'] == pytest.approx(0.05 + half, abs=1e-5))
    # the pairing matters: unpaired, the same numbers' spread (sd ~0.08 per router) would swamp 0.05
    assert d['high'] - d['low'] == pytest.approx(0.2484, abs=1e-3)


def test_a_row_gives_the_mean_and_the_sample_standard_deviation_over_its_seeds():
    from compare import mean_std
    assert (mean_std([1.0, 2.0, 3.0]) == ('2.0000 ± 1.0000', 2.0)
            and mean_std([1.5]) == ('1.5000', 1.5))


def test_one_seed_gives_a_difference_and_no_interval():
    from compare import format_difference, paired_difference
    d = paired_difference({1: 1.2}, {1: 1.0})
    assert d == dict(mean=pytest.approx(0.2), low=None, high=None, n=1)
    assert format_difference(d) == '+0.2000 (1 seed: no interval)'


def test_the_routing_statistics_train_logs_are_the_paper_s_measures_computed_by_hand():
    import torch
    from stats import add_counts, routing_counts, routing_stats, routing_summary
    # one MoE layer, one sequence of 3 tokens, 4 experts, K=2: the tokens take 3, 1 and 1 experts
    masks = torch.tensor([[[[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 1]]]], dtype=torch.bool)
    entropy = torch.tensor([[0.05, 0.1, 1.0]])  # (B, T): bins [0, 1/3), [1/3, 2/3), [2/3, 1]
    counts = routing_counts(masks, entropy, k=2, bins=3)
    assert counts['hist'].tolist() == [[0, 2, 0, 1, 0]]  # tokens that took 0..4 experts
    assert counts['load'].tolist() == [[2, 1, 1, 1]]  # tokens per expert
    assert counts['by_position'].tolist() == [3.0, 1.0, 1.0]
    assert counts['bin_count'].tolist() == [2, 0, 1] and counts['bin_experts'].tolist() == [4, 0, 1]
    assert counts['overspend'] == 1  # token 1 alone took 3 of the 2 its prefix may
    twice = add_counts(counts, counts)
    assert twice['hist'].tolist() == [[0, 4, 0, 2, 0]] and twice['overspend'] == 1  # the worst
    layer = routing_stats(counts['hist'][0], counts['load'][0])
    share = torch.tensor([2, 1, 1, 1]) / 5
    assert (layer['experts_mean'], layer['experts_min'], layer['experts_max']) == (
        pytest.approx(5 / 3), 1, 3)  # per token, not per count seen
    assert layer['load_cv'] == pytest.approx(0.1875 ** 0.5 / 1.25)  # population std / mean
    assert layer['entropy'] == pytest.approx(float(-(share * share.log()).sum() / math.log(4)))
    assert layer['dead_experts'] == 0
    summary = routing_summary(counts, batches=1)
    assert summary['experts_by_entropy'] == [2.0, 0.0, 1.0]  # an empty bin: 0, not NaN
    assert summary['prefix_overspend'] == 1


def finished_runs(root, router, k, **per_seed):
    """Folders root/<router>-k<k>-s<seed> holding a finished run's log: its done record (per_seed:
    {field: [the value for seed 1, seed 2, ...]}), and train records from per_seed['train']."""
    seeds = len(next(iter(per_seed.values())))
    for i in range(seeds):
        folder = root / f'{router}-k{k}-s{i + 1}'
        folder.mkdir(parents=True)
        train = [dict(event='train', iter=it, experts=e)
                 for it, e in per_seed.get('train', [[]] * seeds)[i]]
        done = dict(event='done', **{key: v[i] for key, v in per_seed.items() if key != 'train'})
        (folder / 'log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in train + [done]))


def test_the_analyses_behind_the_results_tables_compute_what_they_say_by_hand(tmp_path):
    import torch
    from analyze import (binned, char_classes, correlation, equal_compute, relu_schedule,
                         slope)
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    assert slope(x, 2 * x + 1) == pytest.approx(2.0) and slope(2 * x + 1, x) == pytest.approx(0.5)
    assert correlation(x, -x) == pytest.approx(-1.0)
    # the class of the character each position predicts: a word's first letter, a letter inside
    # a word, anything else
    itos = dict(enumerate(' ab.'))
    inputs, targets = torch.tensor([[0, 1, 2, 2]]), torch.tensor([[1, 2, 3, 0]])  # ' abb' -> 'ab. '
    assert char_classes(itos, inputs, targets).tolist() == [[0, 1, 2, 2]]
    # experts per token in equal-count bins of a measure, in the measure's order
    b = binned(x, -x, x, torch.tensor([1.0, 2.0, 3.0, 4.0]), bins=2)
    assert b['own'] == dict(x=[0.5, 2.5], experts=[1.5, 3.5], tokens=[2, 2])
    assert b['topk'] == dict(x=[-2.5, -0.5], experts=[3.5, 1.5], tokens=[2, 2])
    # relu's spend by step: each log line's experts from the step the line before it, mean over
    # seeds, rounded, equal neighbours merged
    finished_runs(tmp_path, 'relu', 4, train=[[(25, 7.6), (50, 4.2), (75, 4.4)],
                                              [(25, 8.4), (50, 3.8), (75, 3.6)]])
    assert relu_schedule([str(tmp_path)], 4) == '0:8/25:4'
    # equal compute: topk at a run's own training spend, between K=2 and K=3 by that spend
    finished_runs(tmp_path, 'windowtopk', 2, val_ce=[1.50, 1.40], experts_trained=[2.25, 2.75],
                  experts_mean=[2.0, 2.0])
    finished_runs(tmp_path, 'topk', 2, val_ce=[1.60, 1.50])
    finished_runs(tmp_path, 'topk', 3, val_ce=[1.52, 1.44])
    finished_runs(tmp_path, 'seqtopk', 2, val_ce=[1.55, 1.41])
    row, = equal_compute([str(tmp_path)], 'windowtopk', [2])
    at_spend = [0.75 * 1.60 + 0.25 * 1.52, 0.25 * 1.50 + 0.75 * 1.44]
    assert (row['spend_train'], row['spend_eval'], row['between']) == (2.5, 2.0, (2, 3))
    assert row['vs_topk']['mean'] == pytest.approx(-0.10)
    assert row['vs_topk_at_spend']['mean'] == pytest.approx(
        ((1.50 - at_spend[0]) + (1.40 - at_spend[1])) / 2)
    assert row['vs_seqtopk']['mean'] == pytest.approx(-0.03)


# -----------------------------------------------------------------------------
# sweeps, end to end on the tiny preset (seconds)

def table(stdout):
    return [line for line in stdout.splitlines()
            if line.startswith('| ') and not line.startswith('| ---')]


def test_a_sweep_run_forked_to_save_its_imports_trains_exactly_as_one_started_afresh(workdir):
    # forked.py's ForkedRun, which the sweeps below use: it must not change what a run does
    args = ['--routers=topk,seqtopk', '--top_ks=2', '--seeds=1', '--max_iters=3', '--jobs=2',
            f'--train_args={TINY} --n_exp=4 --eval_interval=3']
    started = run('experiments/sweep.py', '--out_dir=started', *args, cwd=workdir)
    forked = sweep('--out_dir=forked', *args, cwd=workdir)
    assert started.returncode == forked.returncode == 0, started.stderr + forked.stderr

    def records(folder, name):  # each record of the run's log but its times, id and folder
        def bare(value):
            if isinstance(value, dict):
                return {k: bare(v) for k, v in value.items() if k not in ('time', 'run_id')}
            return value.replace(folder, 'S') if isinstance(value, str) else value
        lines = (workdir / folder / name / 'log.jsonl').read_text().splitlines()
        return [bare(json.loads(line)) for line in lines]
    for name in ('topk-k2-s1', 'seqtopk-k2-s1'):
        forked_log = records('forked', name)
        assert forked_log == records('started', name)
        assert len(forked_log) == 4  # start, two evaluations, done


@pytest.mark.long
def test_a_pretraining_sweep_adds_dense_rows_and_paired_differences(workdir):
    args = ['--out_dir=pre', '--routers=topk,mrltopk', '--top_ks=4,2', '--seeds=1,2',
            '--max_iters=4', '--dense=active,total', '--jobs=2',
            f'--train_args={TINY} --n_exp=4 --exp_dim=16 --eval_interval=4']
    result = sweep(*args, cwd=workdir)
    assert result.returncode == 0, result.stderr + result.stdout
    rows = table(result.stdout)[1:]
    # per K: topk, mrltopk, dense at K's active width, dense at the total width
    assert len(rows) == 2 * 4
    assert sum('dense, = active params (FFN 64)' in r for r in rows) == 1  # K=4: 4 * exp_dim
    assert sum('dense, = active params (FFN 32)' in r for r in rows) == 1  # K=2
    # n_exp * exp_dim, shown at each K
    assert sum('dense, = total params (FFN 64)' in r for r in rows) == 2
    summary = json.load(open(workdir / 'pre' / 'sweep.json'))
    dense = [r for r in summary['runs'] if r['router'] == 'dense']
    assert len(dense) == 3 * 2 and all(r['moe_layers'] == 0 and r['experts_mean'] is None
                                       for r in dense)
    active = next(r for r in summary['runs'] if r['name'] == 'dense-active-k2-s1')
    moe = next(r for r in summary['runs'] if r['name'] == 'topk-k2-s1')
    router_params = 2 * 32 * 4  # the MoE's gates, 2 layers of n_embd x n_exp
    assert active['params'] == moe['active_params'] - router_params  # same active parameters
    # the statistic in the table is the paired one, computed here by hand from the runs themselves
    ce = {r['name']: r['val_ce_offline'] for r in summary['runs']}

    def by_hand(a, b):  # mean of the two seeds' differences, +- t(0.975, df=1) * sd / sqrt(2)
        diffs = [ce[f'{a}-s{s}'] - ce[f'{b}-s{s}'] for s in (1, 2)]
        mean = sum(diffs) / 2
        return mean, 12.7062 * abs(diffs[0] - diffs[1]) / math.sqrt(2) / math.sqrt(2)
    row = next(r for r in summary['rows'] if r['router'] == 'mrltopk' and r['K'] == 4)
    runs = [r for r in summary['runs'] if r['name'].startswith('mrltopk-k4-')]
    for column, field in (('experts_per_token', 'experts_mean'),  # evaluated at K
                          ('experts_per_token_trained', 'experts_trained')):  # k drawn each step
        assert row[column] == pytest.approx(sum(r[field] for r in runs) / 2)
    assert row['experts_per_token_trained'] < 4 == row['experts_per_token']
    mean, half = by_hand('mrltopk-k4', 'topk-k4')
    assert (row['diff_vs_topk'], row['diff_low'], row['diff_high'], row['diff_n']) == \
        (pytest.approx(mean), pytest.approx(mean - half, abs=1e-5),
         pytest.approx(mean + half, abs=1e-5), 2)
    assert f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]" in result.stdout
    # and every MoE row against the dense FFN with its active parameters, the comparison that
    # matters
    mean, half = by_hand('topk-k4', 'dense-active-k4')
    row = next(r for r in summary['rows'] if r['router'] == 'topk' and r['K'] == 4)
    assert (row['diff_vs_dense'], row['diff_dense_low']) == (pytest.approx(mean),
                                                             pytest.approx(mean - half, abs=1e-5))
    assert 'diff_causal_low' in (workdir / 'pre' / 'sweep.csv').read_text().splitlines()[0]
    # a re-run reuses every finished run, also one whose log ends in a line cut off mid-write
    with open(workdir / 'pre' / 'topk-k4-s1' / 'log.jsonl', 'a') as f:
        f.write('{"event": "eval", "iter": 4, "val_')
    again = sweep(*args, cwd=workdir)
    assert (again.returncode == 0 and '$ ' not in again.stdout
            and table(again.stdout) == table(result.stdout))
    assert 'topk-k4-s1/log.jsonl: skipped 1 line(s) that are not whole records' in again.stderr
    assert 'Traceback' not in again.stderr


@pytest.mark.long
def test_a_finetune_sweep_pretrains_per_seed_and_tabulates_training_free_rows(workdir):
    args = ['--out_dir=ft', '--finetune=True', '--routers=topk,mrltopk,batchtopk,seqtopk',
            '--top_ks=2', '--seeds=1', '--pretrain_k=4', '--pretrain_iters=6', '--max_iters=3',
            '--jobs=2', f'--train_args={TINY} --n_exp=4 --eval_interval=3']
    result = sweep(*args, cwd=workdir)
    assert result.returncode == 0, result.stderr + result.stdout
    rows = table(result.stdout)[1:]
    # fine-tuned: every router; training-free: all but mrltopk (= topk at evaluation)
    assert len(rows) == 4 + 3
    assert '1 seed: no interval' in result.stdout
    summary = json.load(open(workdir / 'ft' / 'sweep.json'))
    free = {r['router']: r for r in summary['runs'] if r['kind'] == 'training-free'}
    assert set(free) == {'topk', 'batchtopk', 'seqtopk'}
    # a threshold set from training batches, not 0 (all 4)
    assert free['batchtopk']['experts_mean'] < 3
    assert all(r['init_from'].endswith(os.path.join('pretrain-topk-k4-s1', 'ckpt.pt'))
               for r in summary['runs'] if r['kind'] != 'pretrain')
    # evaluated at its step, not trained
    assert all(r['eval_only'] and r['iter'] == 6 for r in free.values())
    tuned = next(r for r in summary['runs'] if r['kind'] == 'train' and r['router'] == 'seqtopk')
    assert (tuned['iter'] == 3 and tuned['val_ce_causal'] is not None
            and free['seqtopk']['val_ce_causal'] is not None)
    # each row against topk of its own kind, its causal column from its causal CE, by hand
    runs = {(r['router'], r['kind']): r for r in summary['runs']}
    for kind in ('train', 'training-free'):
        row = next(r for r in summary['rows'] if r['router'] == 'seqtopk' and r['kind'] == kind)
        seqtopk, topk = runs[('seqtopk', kind)], runs[('topk', kind)]['val_ce_offline']
        assert (row['diff_vs_topk'], row['diff_causal_vs_topk']) == (
            pytest.approx(seqtopk['val_ce_offline'] - topk),
            pytest.approx(seqtopk['val_ce_causal'] - topk))
    # the base trained again: every run from it is trained again too, never reused
    again = sweep(*args, '--pretrain_iters=7', '--rerun_changed=True', cwd=workdir)
    assert again.returncode == 0, again.stderr + again.stdout
    assert 'ft/ft-seqtopk-k2-s1 was made with other settings: its base reruns' in again.stdout
    summary = json.load(open(workdir / 'ft' / 'sweep.json'))
    base = next(r for r in summary['runs'] if r['kind'] == 'pretrain')
    assert base['iter'] == 7 and all(r['from_run'] == base['run_id'] for r in summary['runs']
                                     if r['kind'] != 'pretrain')


def test_bad_sweep_settings_fail_with_one_line(workdir, monkeypatch):
    monkeypatch.chdir(workdir)  # in this process, up to the exit: its one line, no traceback
    for args, message in [(['--routers=seqtopk,topk'], 'must start with topk'),
                          (['--finetune=True', '--dense=active'], 'dense rows compare pretraining'),
                          (['--dense=wide'], "--dense=wide must be")]:
        line = exit_message('experiments/sweep.py', ['--out_dir=bad', *args], monkeypatch)
        assert line.startswith('error: ') and message in line and '\n' not in line, line
    assert not (workdir / 'bad').exists()  # nothing written


def test_a_sweep_checks_every_run_s_settings_before_the_first_one_trains(workdir):
    """As train.py checks them: its rules, its model's (K at most n_exp), a router's own settings
    and --train_args; one line names each run it would refuse, and nothing is made."""
    for args, line in [
            (['--routers=topk,seqtopk', '--top_ks=2,8'],
             "error: train.py would refuse 2 of the 4 runs, so none ran: topk-k8-s1, seqtopk-k8-s1 "
             "(--top_k=8 must be at most --n_exp=4)"),
            (['--routers=topk,seqtopk+bogus=1,relu+seq_causal=2', '--top_ks=2'],
             "error: train.py would refuse 2 of the 3 runs, so none ran: seqtopk+bogus=1-k2-s1 "
             "(unknown setting --bogus; --help lists the settings); relu+seq_causal=2-k2-s1 "
             "(--seq_causal=2 must be True or False)"),
            (['--train_args=--n_exp=four'],
             "error: --train_args: --n_exp=four must be an integer")]:
        result = run('experiments/sweep.py', '--out_dir=checked', '--seeds=1', '--max_iters=4',
                     f'--train_args={TINY} --eval_interval=10', *args, cwd=workdir)
        assert one_error_line(result) == line
        assert not (workdir / 'checked').exists()


def test_a_sweep_stops_at_its_first_failed_run_and_starts_no_other(workdir):
    result = sweep('--out_dir=failing', '--routers=topk', '--top_ks=2', '--seeds=1,2,3',
                   '--max_iters=2', f'--train_args={TINY} --dataset=absent', cwd=workdir)
    assert result.returncode != 0 and 'Traceback' not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the run in failing/topk-k2-s1 failed (no data in data/absent/; make it with "
        "`python prepare.py --text=FILE --dataset=absent` (or `--source=SOURCE`), or use the "
        "built-in --dataset=shakespeare_char); see failing/topk-k2-s1.out")
    assert '[1/3] $ ' in result.stdout and '[2/3]' not in result.stdout, result.stdout
    assert sorted(f for f in os.listdir(workdir / 'failing') if f.endswith('.out')) == [
        'topk-k2-s1.out']


# -----------------------------------------------------------------------------
# figures

@pytest.fixture
def drawn(monkeypatch):
    """The figures plot.py saves, by file name, as drawn (their axes' data, not just a PNG)."""
    from matplotlib.figure import Figure
    figures, savefig = {}, Figure.savefig

    def keep(fig, path, *args, **kwargs):
        figures[os.path.basename(str(path))] = fig
        return savefig(fig, path, *args, **kwargs)
    monkeypatch.setattr(Figure, 'savefig', keep)
    return figures


def lines_of(fig, panel=0):
    """{label: (x, y)} of a figure's panel's lines, and of its error bars' lines."""
    ax = fig.axes[panel]
    lines = [(line.get_label(), line) for line in ax.get_lines()] + [
        (bars.get_label(), bars.lines[0]) for bars in ax.containers if hasattr(bars, 'has_yerr')]
    return {label: (list(line.get_xdata()), list(line.get_ydata()))
            for label, line in lines if not label.startswith('_')}


def synthetic_sweep(folder, finetune=True):
    """A sweep.json shaped like sweep.py's, with made-up numbers (no training)."""
    rows = []
    for k in (8, 4, 2):
        for router in ('topk', 'mrltopk', 'seqtopk'):
            for kind in ('train', 'training-free'):
                diff = None if router == 'topk' else -0.01 * 8 / k
                rows.append(dict(router=router, kind=kind, K=k, diff_vs_topk=diff, diff_n=3,
                                 diff_low=None if diff is None else diff - 0.01,
                                 diff_high=None if diff is None else diff + 0.01,
                                 diff_causal_vs_topk=diff,
                                 diff_causal_low=None if diff is None else diff - 0.02,
                                 diff_causal_high=None if diff is None else diff + 0.02))
    rows.append(dict(router='dense', kind='active', K=2, diff_vs_topk=0.3, diff_n=3, diff_low=0.2,
                     diff_high=0.4))
    (folder / 'sweep.json').write_text(json.dumps(dict(rows=rows, runs=[], finetune=finetune)))


def test_the_paired_difference_figure_is_drawn_from_a_sweep_json(tmp_path, drawn):
    import plot
    synthetic_sweep(tmp_path)
    plot.main([f"--sweep={tmp_path / 'sweep.json'}", f"--out_dir={tmp_path}"])
    assert (tmp_path / 'paired_difference.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    fig = drawn['paired_difference.png']
    assert [ax.get_title() for ax in fig.axes] == ["fine-tuned: val CE minus topk's, same seed",
                                                   "training-free: val CE minus topk's, same seed"]
    for panel in (0, 1):
        lines = lines_of(fig, panel)  # every router but topk; seqtopk offline and causal
        assert set(lines) == {'mrltopk', 'seqtopk', 'seqtopk (causal routing)'}
        assert lines['mrltopk'][1] == pytest.approx([-0.04, -0.02, -0.01])  # at K = 2, 4, 8
        assert [round(x) for x in lines['seqtopk'][0]] == [2, 4, 8]
    with pytest.raises(SystemExit, match='run experiments/sweep.py first'):
        plot.main([f"--sweep={tmp_path / 'missing.json'}"])


# -----------------------------------------------------------------------------
# experiments: plots from logs, sweeps

def synthetic_run(path, router, T=8, layers=2, N=4):
    """A log.jsonl shaped like train.py's, with made-up numbers (no training needed)."""
    import json
    path.mkdir()
    def layer(i):
        return dict(experts_mean=2.0, experts_min=1, experts_max=3, experts_hist=[0, 10, 20, 10, 0],
                    load=[10, 20, 30, 20], load_var=50.0, load_cv=0.35 - 0.05 * i, dead_experts=0,
                    entropy=0.9 + 0.01 * i)
    records = [dict(event='start', model_args=dict(router=router, top_k=2, n_exp=N))]
    for it in (0, 10, 20):
        rec = dict(event='eval', iter=it, layers=[layer(i) for i in range(layers)],
                   val_ce=3.0 - it / 100, val_experts_by_position=[2.0] * T,
                   val_experts_by_entropy=[1.5, 2.0, 2.5, 0.0],
                   val_tokens_by_entropy=[5, 10, 5, 0])
        if router == 'seqtopk':
            rec.update(val_causal_experts_by_position=[2 + 0.1 * t for t in range(T)],
                       val_offline_experts_by_position=[2.0] * T)
        records.append(rec)
    (path / 'log.jsonl').write_text('\n'.join(json.dumps(r) for r in records) + '\n')


def test_plots_are_written_from_logs_alone(tmp_path, drawn):
    import plot
    synthetic_run(tmp_path / 'a', 'topk')
    synthetic_run(tmp_path / 'b', 'seqtopk')
    plot.main([str(tmp_path / 'a'), str(tmp_path / 'b'), f"--out_dir={tmp_path}"])
    for name in ('load_variance', 'entropy_per_layer', 'experts_histogram', 'experts_by_position',
                 'experts_by_entropy'):
        assert (tmp_path / f'{name}.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    # each picture shows the logs' numbers: the mean over layers, per layer, per position, per bin
    assert (lines_of(drawn['load_variance.png'])['topk K=2']
            == ([0, 10, 20], pytest.approx([0.325] * 3)))
    assert lines_of(drawn['entropy_per_layer.png'])['seqtopk K=2'][1] == pytest.approx([0.9, 0.91])
    by_position = lines_of(drawn['experts_by_position.png'])
    assert set(by_position) == {'topk K=2', 'seqtopk K=2 online', 'seqtopk K=2 offline'}
    assert by_position['seqtopk K=2 online'][1] == pytest.approx([2 + 0.1 * t for t in range(8)])
    assert lines_of(drawn['experts_by_entropy.png'])['topk K=2'] == (  # the empty bin left out
        pytest.approx([0.125, 0.375, 0.625]), pytest.approx([1.5, 2.0, 2.5]))
    bars = [p.get_height() for p in drawn['experts_histogram.png'].axes[0].patches]
    assert bars == pytest.approx([0, 0.25, 0.5, 0.25, 0] * 2)  # tokens per expert count, both runs
    with pytest.raises(SystemExit, match='no log.jsonl'):
        plot.main([str(tmp_path / 'missing')])


def test_training_curves_are_drawn_per_seed_with_the_step_each_run_leaves_the_plateau(
        tmp_path, capsys, drawn):
    import plot
    for seed, escape in ((1, 30), (2, 60)):
        path = tmp_path / f'topk-k2-s{seed}'
        path.mkdir()
        train = [dict(event='train', iter=it, ce=2.45 if it < escape else 2.0)
                 for it in range(10, 100, 10)]
        (path / 'log.jsonl').write_text(
            '\n'.join(json.dumps(r) for r in [dict(event='start')] + train) + '\n')
    plot.main(['--curves', str(tmp_path / 'topk-k2-s1'), str(tmp_path / 'topk-k2-s2'),
               f"--out_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert ('topk-k2-s1: below 2.3 from step 30' in out
            and 'topk-k2-s2: below 2.3 from step 60' in out)
    curves = [line for line in drawn['train_curves.png'].axes[0].get_lines()
              if len(line.get_xdata()) > 2]
    # one row, a line per seed
    assert len(curves) == 2 and curves[0].get_color() == curves[1].get_color()
    assert list(curves[1].get_ydata()) == [2.45] * 5 + [2.0] * 4


def test_the_decoding_figure_is_drawn_from_a_bench_json(tmp_path, drawn):
    import plot
    decode = [dict(router=r, way=w, new_tokens=512, cached_tok_s=s, recompute_tok_s=12.0)
              for r, w, s in (('topk', 'eager', 90.0), ('topk', 'compiled', 150.0),
                              ('seqtopk', 'eager', 80.0), ('seqtopk', 'compiled', 130.0),
                              # a row topk has not: no bar
                              ('seqtopk', 'compiled, experts capped at top_k', 140.0))]
    (tmp_path / 'bench.json').write_text(
        json.dumps(dict(device='CPU', dtype='float32', decode=decode)))
    plot.main([f"--bench={tmp_path / 'bench.json'}",
               f"--out_dir={tmp_path / 'figures'}"])  # not there yet
    assert (tmp_path / 'figures' / 'decoding.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    bars = [p.get_height() for p in drawn['decoding.png'].axes[0].patches]
    # recompute, eager, compiled: topk, seqtopk
    assert bars == [12.0, 12.0, 90.0, 80.0, 150.0, 130.0]


def sweep_in_training(workdir, out_dir, seeds, *extra, python=()):
    """experiments/sweep.py started on tiny 300-step runs (python: what runs it), once its first
    run has trained a step: the process, its arguments and that run's log."""
    import subprocess
    import sys
    import time
    from conftest import OFFLINE_ENV
    args = [f'--out_dir={out_dir}', '--routers=topk', '--top_ks=2', f'--seeds={seeds}',
            '--max_iters=300', *extra,
            f'--train_args={TINY} --n_exp=4 --eval_interval=1000 --log_interval=1']
    started = subprocess.Popen(
        [sys.executable, *python, os.path.join(REPO, 'experiments', 'sweep.py'), *args],
        cwd=workdir, env=OFFLINE_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = workdir / out_dir / 'topk-k2-s1' / 'log.jsonl'
    deadline = time.time() + HANG
    while not (log.exists() and '"event": "train"' in log.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    return started, args, log


def test_an_interrupted_sweep_stops_its_runs_and_the_same_command_resumes_them(workdir):
    import signal
    started, args, log = sweep_in_training(workdir, 'stopped', '1,2', '--jobs=1')
    started.send_signal(signal.SIGTERM)
    out, err = started.communicate(timeout=HANG)
    assert started.returncode != 0 and 'Traceback' not in err, err
    assert err.strip().splitlines()[-1].startswith(
        'SIGTERM: stopped the sweep with 0 of 2 runs finished')
    stopped = [json.loads(line) for line in log.read_text().splitlines()]
    step = stopped[-1]['iter']
    assert (stopped[-1]['event'] == 'stopped' and 0 < step < 300
            and (log.parent / 'ckpt.pt').exists())
    assert not (workdir / 'stopped' / 'sweep.json').exists()
    again = sweep(*args, cwd=workdir)
    assert again.returncode == 0, again.stderr + again.stdout
    # resumed, not restarted
    assert '--out_dir=stopped/topk-k2-s1 --init_from=resume' in again.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    # no step twice
    assert [r['iter'] for r in records if r['event'] == 'train'] == list(range(1, 301))
    assert json.load(open(workdir / 'stopped' / 'sweep.json'))['rows']


def children(pid):
    """The ids of pid's child processes, from Linux's /proc."""
    found = []
    for stat in glob.glob('/proc/[0-9]*/stat'):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            if open(stat).read().rsplit(')', 1)[1].split()[1] == str(pid):
                found.append(int(stat.split('/')[2]))
    return found


def running(pid):  # neither gone nor a zombie
    with contextlib.suppress(OSError):
        return open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z'
    return False


def stopped_saved(log):
    """The run's log ends with its stop, mid-run, and its checkpoint is there."""
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return (records[-1]['event'] == 'stopped' and 0 < records[-1]['iter'] < 300
            and (log.parent / 'ckpt.pt').exists())


@pytest.mark.parametrize('name', ['SIGHUP', 'SIGINT'])  # its terminal closed; Ctrl-C
def test_a_sweep_s_runs_save_and_stop_with_it_on_sighup_and_ctrl_c(workdir, name):
    import signal
    started, _, log = sweep_in_training(workdir, name, '1')
    started.send_signal(getattr(signal, name))
    out, err = started.communicate(timeout=HANG)
    assert err.strip().splitlines()[-1].startswith(
        f'{name}: stopped the sweep with 0 of 1 runs finished'), err
    assert stopped_saved(log)


def test_a_sweep_killed_leaves_no_run_training_its_run_saves_and_stops(workdir):
    import signal
    import time
    started, _, log = sweep_in_training(workdir, 'killed', '1')
    [train] = children(started.pid)
    started.kill()  # SIGKILL: the sweep can do nothing; the kernel tells its run (SIGTERM)
    started.communicate(timeout=HANG)
    try:
        deadline = time.time() + HANG
        while running(train) and time.time() < deadline:
            time.sleep(0.1)
        assert not running(train) and stopped_saved(log)
    finally:
        with contextlib.suppress(OSError):
            os.kill(train, signal.SIGKILL)


def python_with(prelude):
    """python's arguments that run prelude, then the script named next, as `python script`."""
    return ('-c', prelude + "\nimport os, runpy, sys\nsys.argv = sys.argv[1:]\n"
            "sys.path.insert(0, os.path.dirname(sys.argv[0]))\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')")


def test_a_slurm_sweep_without_submitit_says_how_to_install_it(workdir):
    # what a cluster does to the jobs: tests/test_slurm.py, on a real SLURM
    import subprocess
    import sys
    no_submitit = subprocess.run(
        [sys.executable, *python_with("import sys\nsys.modules['submitit'] = None"),
         os.path.join(REPO, 'experiments', 'sweep.py'), '--out_dir=nosubmitit', '--seeds=1',
         '--launcher=slurm'], cwd=workdir, capture_output=True, text=True)
    assert one_error_line(no_submitit) == \
        "error: --launcher=slurm needs submitit: pip install submitit"


@pytest.mark.parametrize('ends, last_event, requeued', [
    ('os.kill(os.getpid(), signal.SIGTERM)', None, True),  # killed as it started
    ('', 'stopped', True), ('', 'done', False), ('sys.exit(1)', 'stopped', False),
    ('os.kill(os.getpid(), signal.SIGKILL)', None, False)])  # the OOM killer: it would again
def test_in_a_slurm_job_a_run_the_cluster_s_sigterm_stopped_goes_back_to_the_queue(
        tmp_path, monkeypatch, ends, last_event, requeued):
    # the SIGTERM of a requeue, a preemption or the time limit: train.py saved and stopped, or
    # killed before it listened for it (the time limit's warning, its requeue as train.py started:
    # tests/test_slurm.py); submitit's own requeue can be lost as train.py is forked
    import signal
    import subprocess
    import sys

    import sweep as sweep_py
    monkeypatch.setenv('SUBMITIT_EXECUTOR', 'slurm')
    monkeypatch.setattr(sweep_py.Job, 'requeue', lambda job: calls.append(job.folder))
    monkeypatch.setattr(signal, 'signal', lambda *_: None)  # pytest's own handlers stay
    folder, calls = str(tmp_path / 'run'), []
    os.makedirs(folder)
    if last_event:
        open(os.path.join(folder, 'log.jsonl'), 'w').write(json.dumps(dict(event=last_event)))
    code = sweep_py.Job([sys.executable, '-c', f'import os, signal, sys\n{ends}'], folder, True)()
    assert (code, calls) == (subprocess.run([sys.executable, '-c', 'import os, signal, sys\n'
                                             + ends]).returncode, [folder] if requeued else [])


# -----------------------------------------------------------------------------
# reruns that could mix: a sweep reuses a run only as it would make it now, one sweep an out_dir

@pytest.mark.long
def test_a_sweep_reuses_a_run_only_if_it_was_made_with_the_settings_it_would_give_it_now(workdir):
    import shutil
    args = ['--out_dir=same', '--routers=topk,seqtopk', '--top_ks=2', '--seeds=1', '--max_iters=4',
            f'--train_args={TINY} --n_exp=4 --exp_dim=16 --eval_interval=4']
    first = sweep(*args, cwd=workdir)
    assert first.returncode == 0, first.stderr
    assert 'runs made at commit ' in first.stdout
    shutil.copy(workdir / 'same' / 'sweep.json', workdir / 'old_sweep.json')
    log = workdir / 'same' / 'topk-k2-s1' / 'log.jsonl'
    # a setting the run's log lacks (added to the code since), at its default: still the same run
    records = [json.loads(line) for line in log.read_text().splitlines()]
    for record in records:
        record.get('config', {}).pop('k_schedule', None)
    log.write_text(''.join(json.dumps(r) + '\n' for r in records))
    assert sweep(*args, cwd=workdir).returncode == 0
    # other settings: max_iters, train_args, a code default (rope, recorded as before it changed)
    for record in records:
        record.get('config', {}).update(rope=False)
    log.write_text(''.join(json.dumps(r) + '\n' for r in records))
    changed = sweep(*args, '--max_iters=6', cwd=workdir)
    line = one_error_line(changed)
    assert "2 run(s) in same were made with other settings (above); run them again with " \
           "--rerun_changed=True, or give another --out_dir" in line
    assert ("same/topk-k2-s1 was made with other settings: max_iters 4 -> 6; rope False -> True"
            in changed.stdout)
    assert "same/seqtopk-k2-s1 was made with other settings: max_iters 4 -> 6\n" in changed.stdout
    # no table of mixed runs
    assert json.load(open(workdir / 'same' / 'sweep.json'))['max_iters'] == 4
    again = sweep(*args, '--max_iters=6', '--rerun_changed=True', cwd=workdir)
    assert again.returncode == 0, again.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert records[0]['event'] == 'start' and records[-1]['iter'] == 6  # trained again from scratch
    assert json.load(open(workdir / 'same' / 'sweep.json'))['max_iters'] == 6
    # figures from the old sweep.json would mix its table with the runs there now: refused
    shutil.copy(workdir / 'old_sweep.json', workdir / 'same' / 'old.json')
    line = one_error_line(run('experiments/plot.py', '--sweep=same/old.json', '--out_dir=figs',
                              cwd=workdir))
    assert ("topk-k2-s1 is not the run its sweep.json was made from (it was trained again since)"
            in line)
    assert run('experiments/plot.py', '--sweep=same/sweep.json', '--out_dir=figs',
               cwd=workdir).returncode == 0


def test_a_second_sweep_into_a_live_sweep_s_out_dir_is_refused_and_the_first_finishes_whole(
        workdir):
    import signal
    import subprocess
    import sys
    import time
    from conftest import OFFLINE_ENV
    args = ['--out_dir=locked', '--routers=topk', '--top_ks=2', '--seeds=1,2', '--max_iters=60',
            f'--train_args={TINY} --n_exp=4 --eval_interval=60']
    first = subprocess.Popen([sys.executable, os.path.join(REPO, 'experiments', 'sweep.py'), *args],
                             cwd=workdir, env=OFFLINE_ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + HANG
    lock = workdir / 'locked' / 'sweep.lock'
    while not (lock.exists() and lock.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    os.kill(first.pid, signal.SIGSTOP)  # live, its lock held, however fast its runs end
    try:
        line = one_error_line(run('experiments/sweep.py', *args, cwd=workdir))
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert line.startswith(
        f"error: --out_dir=locked is in use by a live sweep (pid {first.pid} on host ")
    out, err = first.communicate(timeout=HANG)
    assert first.returncode == 0, err
    assert ('wrote locked/sweep.json' in out
            and len(json.load(open(workdir / 'locked' / 'sweep.json'))['runs']) == 2)
    # a lock file left by a sweep that is gone (killed): the kernel's lock went with it
    gone = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'],
                          capture_output=True, text=True)
    (workdir / 'locked' / 'sweep.lock').write_text(
        f'pid {int(gone.stdout)} on host here, since then')
    again = run('experiments/sweep.py', *args, cwd=workdir)
    assert again.returncode == 0, again.stderr


@pytest.mark.long
def test_the_analyses_of_a_finished_sweep_run_and_print_their_tables(workdir, tmp_path):
    args = ['--out_dir=parts', '--routers=topk,seqtopk,relu,windowtopk', '--top_ks=2',
            '--seeds=1,2', '--max_iters=4',
            f'--train_args={TINY} --n_exp=4 --exp_dim=16 --eval_interval=4 --log_interval=2']
    assert sweep(*args, cwd=workdir).returncode == 0
    more = sweep(*args[:2], '--routers=topk', '--top_ks=3', *args[3:], cwd=workdir)
    assert more.returncode == 0, more.stderr
    schedule = run('experiments/analyze.py', 'parts', '--relu_schedule', '--top_ks=2', cwd=workdir)
    assert schedule.returncode == 0, schedule.stderr
    assert re.fullmatch(r"K=2: --k_schedule=0:\d+(/\d+:\d+)*", schedule.stdout.strip())
    equal = run('experiments/analyze.py', 'parts', '--equal_compute', '--router=windowtopk',
                '--top_ks=2', cwd=workdir)
    assert equal.returncode == 0, equal.stderr
    row = next(line for line in equal.stdout.splitlines() if line.startswith('| 2 |'))
    spend = float(row.split('|')[2])  # windowtopk's measured experts per token in training
    assert spend >= 2 and f"| {math.floor(spend)}, {math.ceil(spend)} |" in row
    # routed causally: each router's ways against topk's runs on the same val batches, so that
    # topk against itself is 0 (its logged CE is over other batches)
    causal = run('experiments/analyze.py', 'parts', '--causal', '--router=topk', '--top_ks=2',
                 '--batches=2', cwd=workdir)
    assert causal.returncode == 0, causal.stderr
    rows = [line.split('|') for line in causal.stdout.splitlines() if line.startswith('| 2 |')]
    assert len(rows) == 4 and all(r[5].strip() == '+0.0000 [+0.0000, +0.0000]' for r in rows)
    # each router's rows say how that router routes (seqtopk's were windowtopk's)
    for router, labels in (
            ('seqtopk', ["offline, as it trains (Eq. 5: each sequence's top T·K at once)",
                         "as topk (each token its top K)",
                         "by the online rule (Eq. 7, within its bounds): what sample.py routes",
                         "online − offline, paired"]),
            ('windowtopk', ["as its code evaluates (a window of the batch at once)",
                            "as generation routed it before (each token its top K: a window of "
                            "1 x 1)", "by the online rule (Eq. 7, its floor, no cap): what "
                            "sample.py routes", "online − window, paired"])):
        causal = run('experiments/analyze.py', 'parts', '--causal', f'--router={router}',
                     '--top_ks=2', '--batches=2', cwd=workdir)
        assert causal.returncode == 0, causal.stderr
        assert [line.split('|')[2].strip() for line in causal.stdout.splitlines()
                if line.startswith('| 2 |')] == labels, causal.stdout
    # random scores: a floor only adds
    window = run('experiments/analyze.py', '--window_spend', cwd=workdir)
    assert window.returncode == 0, window.stderr
    spends = [[float(c) for c in line.split('|')[5:7]] for line in window.stdout.splitlines()[2:]]
    ks = [int(line.split('|')[2]) for line in window.stdout.splitlines()[2:]]
    # a floor adds at most `floor` experts per token to the window's T·K: 1 + floor / K at most
    assert len(spends) == 8 and all(1 <= one <= two <= 1 + 2 / k for (one, two), k in zip(spends,
                                                                                         ks))
    chars = run('experiments/analyze.py', 'parts', '--chars', '--top_ks=2', '--batches=2',
                f'--out_dir={tmp_path}', cwd=workdir)
    assert chars.returncode == 0, chars.stderr
    assert all(c in chars.stdout
               for c in ('| word start |', '| inside a word |', '| space or punctuation |'))
    assert ((tmp_path / 'chars_k2.png').exists()
            and len(json.load(open(tmp_path / 'chars_k2.json'))) == 2)


def test_an_analysis_without_its_runs_or_data_is_one_line_before_any_table(tmp_path, monkeypatch,
                                                                           capsys):
    monkeypatch.chdir(tmp_path)
    for name in ('topk-k2-s1', 'seqtopk-k2-s1'):  # finished runs, as analyze finds them
        os.makedirs(f'sweep/{name}')
        (tmp_path / 'sweep' / name / 'log.jsonl').write_text('{"event": "done", "val_ce": 1.5}\n')
    for args, message in (
            ([], "choose an analysis: --relu_schedule, --equal_compute"),
            (['--window_spend', '--top_ks=4,x'], "--top_ks=4,x must be a comma-separated list"),
            (['sweep', 'nope', '--chars'], "no sweep folder nope"),
            (['sweep', '--chars', '--top_ks=2,4'], "--chars reads seqtopk-k4-s* runs, but sweep "
             "holds no finished one"),
            (['--relu_schedule', '--top_ks=2'], "--relu_schedule reads relu-k2-s* runs, but no "
             "folder holds"),
            (['sweep', '--chars', '--top_ks=2'], "no data in data/shakespeare_char/: give the "
             "--dataset")):
        line = exit_message('experiments/analyze.py', args, monkeypatch)
        assert line.startswith(f"error: {message}"), line
    assert capsys.readouterr().out == ''  # no table, not even its header


def test_runs_are_paired_only_if_made_alike_but_for_what_is_compared(tmp_path, monkeypatch,
                                                                     capsys):
    # a topk run at learning rate 1e-3 was paired with a seqtopk run at 2e-3, without a word
    monkeypatch.chdir(tmp_path)
    config = dict(learning_rate=1e-3, max_iters=800, out_dir='x', seed=1)
    finished_runs(tmp_path / 'a', 'topk', 2, val_ce=[1.6], config=[dict(config, router='topk')])
    finished_runs(tmp_path / 'b', 'seqtopk', 2, val_ce=[1.5], experts_trained=[2.0],
                  experts_mean=[2.0], config=[dict(config, router='seqtopk', out_dir='y')])
    finished_runs(tmp_path / 'c', 'seqtopk', 2, val_ce=[1.5], experts_trained=[2.0],
                  experts_mean=[2.0], config=[dict(config, router='seqtopk', learning_rate=2e-3)])
    analyze = ['--equal_compute', '--router=seqtopk', '--top_ks=2']
    assert exit_message('experiments/analyze.py', ['a', 'c', *analyze], monkeypatch) == (
        "error: c/seqtopk-k2-s1 and a/topk-k2-s1 differ in --learning_rate (0.002, 0.001) "
        "besides what is compared; give sweep folders whose runs differ only in that")
    assert capsys.readouterr().out == ''
    # the router and where each ran may differ: the pair is made
    import analyze as module
    module.main(['a', 'b', *analyze])
    assert capsys.readouterr().out.splitlines()[-1].split('|')[5].strip() == '-0.1000 (1 seed: ' \
        'no interval)'


def test_equal_compute_says_which_topk_runs_a_blank_difference_needs(tmp_path, monkeypatch,
                                                                    capsys):
    import analyze
    monkeypatch.chdir(tmp_path)
    for name, done in (('relu-k2-s1', dict(val_ce=1.5, experts_trained=2.5, experts_mean=2.4)),
                       ('topk-k2-s1', dict(val_ce=1.6))):  # relu spent 2.5: topk at 2 and 3
        os.makedirs(f'sweep/{name}')
        (tmp_path / 'sweep' / name / 'log.jsonl').write_text(json.dumps(dict(event='done',
                                                                             **done)) + '\n')
    analyze.main(['sweep', '--equal_compute', '--router=relu', '--top_ks=2'])
    row = capsys.readouterr().out.splitlines()[-1].split('|')
    assert row[6].strip() == '2, 3' and row[7].strip() == (
        'n/a: needs topk-k2 and topk-k3 runs of its seeds')


def test_a_sweep_run_that_exits_without_finishing_is_reported_failed_in_one_line(workdir):
    import signal
    started, _, _ = sweep_in_training(workdir, 'unfinished', '1')
    # its train.py stops, saved, and exits 0: not finished
    os.kill(children(started.pid)[0], signal.SIGTERM)
    out, err = started.communicate(timeout=HANG)
    assert started.returncode != 0 and 'Traceback' not in err, err
    assert err.strip().splitlines()[-1] == (
        "error: the run in unfinished/topk-k2-s1 exited without finishing (its log has no done "
        "record); see unfinished/topk-k2-s1.out")
    assert not (workdir / 'unfinished' / 'sweep.json').exists()


def test_plot_s_bad_input_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'route.json').write_text(json.dumps(dict(device='cpu', route=[{}], decode=[])))
    (tmp_path / 'broken.json').write_text('{"decode": [')
    for args, message in (
            (['--bench=route.json'], "route.json holds no decode results; give the file `python "
             "bench.py --what=decode --out_dir=.` writes"),
            (['--bench=broken.json'], "broken.json holds no decode results"),
            (['--sweep=route.json'], "route.json holds no rows results; give the file "
             "experiments/sweep.py writes"),
            (['--bench=missing.json'], "no missing.json; run `python bench.py"),
            (['--curves', '--escape=low'], "argument --escape: invalid float value: 'low'")):
        line = exit_message('experiments/plot.py', args, monkeypatch)
        assert line.startswith(f"error: {message}"), line
    assert sorted(os.listdir(tmp_path)) == ['broken.json', 'route.json']


def test_word_pieces_are_drawn_whole_each_box_as_wide_as_its_text():
    import plot
    from matplotlib.patches import Rectangle
    assert plot.layout(['ROM', 'EO', ':⏎', '·the'], 5) == [(0, 0, 3), (3, 0, 2), (0, 1, 2),
                                                           (0, 2, 4)]
    fig = plot.token_figure([['ROM', 'EO', ':\n', ' the']], [[[1, 2, 3, 2]]], [2], ['GPT-2 BPE'])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.texts][2:6] == ['ROM', 'EO', ':⏎', '·the']
    assert [p.get_width() for p in ax.patches if isinstance(p, Rectangle)] == [3, 2, 2, 4]


def test_each_run_s_tokens_are_coloured_by_its_own_k(monkeypatch):
    # two runs whose every token took exactly its K (1 and 3): every box the grey of "K"
    import types
    import plot
    import torch
    from matplotlib.patches import Rectangle
    runs = {'k1': 1, 'k3': 3}
    monkeypatch.setattr(plot, 'sample_routing', lambda run, *_: (
        ['a', 'b', 'c'], torch.full((2, 3), runs[run]),
        types.SimpleNamespace(router='topk', top_k=runs[run])))
    ax = plot.explain(list(runs))['tokens.png'].axes[0]
    grey = tuple(plot.plt.get_cmap('coolwarm')(0.5))  # a token that took exactly K
    boxes = [p.get_facecolor() for p in ax.patches if isinstance(p, Rectangle)]
    assert len(boxes) == 2 * 3 and set(boxes) == {grey}  # equal layers drawn once


def test_explain_says_in_one_line_that_a_dense_run_has_no_experts_to_colour(workdir):
    result = run('train.py', TINY, '--max_iters=1', '--moe_every=0', '--out_dir=dense',
                 cwd=workdir)
    assert result.returncode == 0, result.stderr
    result = run('experiments/plot.py', '--explain', 'dense', '--out_dir=pictures', cwd=workdir)
    assert one_error_line(result) == (
        "error: dense holds a dense GPT (no MoE layer): its tokens take no experts to colour")


def test_explain_samples_a_run_whose_vocabulary_cannot_spell_its_prompt(workdir, monkeypatch,
                                                                        capsys):
    import plot
    monkeypatch.chdir(workdir)
    text, per_layer, config = plot.sample_routing('run', 'ROMEO€', 8)  # no '€' in Shakespeare
    assert "note: run's vocabulary cannot spell 'ROMEO€'" in capsys.readouterr().out
    assert len(text) == per_layer.shape[1] == 8 and config.top_k == 2


# NumPy 2 warns where matplotlib converts a tensor without a copy keyword; a later NumPy raises
@pytest.mark.filterwarnings('error:__array__ implementation:DeprecationWarning')
def test_the_pictures_that_explain_routing_show_each_router_s_selection(
        workdir, tmp_path, drawn, monkeypatch):
    import plot
    from matplotlib.patches import Rectangle
    monkeypatch.chdir(workdir)
    # run/: a tiny topk run, its text coloured
    plot.main(['--explain', 'run', f'--out_dir={tmp_path}'])

    def selections(name):  # per panel: the boxed entries, and the count written at each row's end
        panels = []
        for ax in drawn[name].axes:
            boxes = sum(isinstance(p, Rectangle) for p in ax.patches)
            counts = [int(t.get_text()) for t in ax.texts if t.get_text().isdigit()]
            panels.append((boxes, counts))
        return panels
    (topk, topk_counts), (seqtopk, seqtopk_counts) = selections('selection.png')
    assert topk == seqtopk == 8 * 2 and topk_counts == [2] * 8  # the same compute, T*K = 16
    assert sum(seqtopk_counts) == 16 and set(seqtopk_counts) != {2} and max(seqtopk_counts) <= 4
    assert [boxes for boxes, _ in selections('batch.png')] == [32, 32, 32]  # B*T*K for all three
    totals = [re.search(r'sequence totals: (\d+), (\d+) experts', ax.get_title()).groups()
              for ax in drawn['batch.png'].axes]  # topk and seqtopk: T*K each; batchtopk: B*T*K
    assert totals[:2] == [('16', '16')] * 2 and sum(map(int, totals[2])) == 32
    assert all(ax.get_title().endswith('total: 16 experts') for ax in drawn['selection.png'].axes)
    offline, online = selections('online.png')
    assert offline[0] == 16 and online[1] != offline[1]  # online routes token m by tokens 1..m
    tokens = drawn['tokens.png'].axes[0]
    assert sum(isinstance(p, Rectangle) for p in tokens.patches) >= 120  # a coloured box per token
    assert (sorted(os.listdir(tmp_path))
            == ['batch.png', 'online.png', 'selection.png', 'tokens.png'])
    from matplotlib.image import imread
    for name in ('selection.png', 'batch.png', 'online.png'):  # README's copies drawn by this code
        now, committed = (imread(os.path.join(folder, name)).shape
                          for folder in (tmp_path, os.path.join(REPO, 'results', 'explain')))
        assert all(abs(a - b) <= 4 for a, b in zip(now, committed)), (name, now, committed)


# -----------------------------------------------------------------------------
# settings that change no trained weight or evaluation (sweep.IGNORED): a sweep reuses runs that
# differ only in them, analyze.py pairs them (issue 75)

LOG_ONLY = dict(wandb_log=True, wandb_project='other', wandb_run_name='x', log_interval=1,
                compile=True, moe_impl='loop', always_save_checkpoint=True)


def test_a_finished_sweep_run_again_with_wandb_logging_on_reuses_its_runs(workdir):
    # adding --wandb_log=True (or log_interval, compile...) marked every run "made with other
    # settings"
    args = ['--out_dir=logged', '--routers=topk', '--top_ks=2', '--seeds=1', '--max_iters=4']
    train_args = f'--train_args={TINY} --n_exp=4 --exp_dim=16 --eval_interval=4'
    first = sweep(*args, train_args, cwd=workdir)
    assert first.returncode == 0, first.stderr
    log = workdir / 'logged' / 'topk-k2-s1' / 'log.jsonl'
    made = log.read_bytes()
    again = sweep(*args, train_args + ''.join(f' --{k}={v}' for k, v in LOG_ONLY.items()),
                  cwd=workdir)
    assert again.returncode == 0, again.stderr + again.stdout
    assert ' $ ' not in again.stdout and log.read_bytes() == made  # no run trained again
    # what the log evaluates is no logging setting
    other = sweep(*args, train_args + ' --eval_interval=2', cwd=workdir)
    assert 'was made with other settings: eval_interval 4 -> 2' in other.stdout, other.stdout
    one_error_line(other)


def test_analyze_pairs_a_run_logged_to_wandb_with_one_that_was_not(tmp_path, monkeypatch,
                                                                   capsys):
    # analyze.py refused: "differ in --wandb_log (False, True) besides what is compared"
    monkeypatch.chdir(tmp_path)
    config = dict(learning_rate=1e-3, max_iters=800, seed=1, wandb_log=False, log_interval=25,
                  compile=False, moe_impl='grouped', always_save_checkpoint=False)
    finished_runs(tmp_path / 'a', 'topk', 2, val_ce=[1.6], config=[dict(config, router='topk')])
    finished_runs(tmp_path / 'b', 'seqtopk', 2, val_ce=[1.5], experts_trained=[2.0],
                  experts_mean=[2.0], config=[dict(config, router='seqtopk', **LOG_ONLY)])
    import analyze
    analyze.main(['a', 'b', '--equal_compute', '--router=seqtopk', '--top_ks=2'])
    assert capsys.readouterr().out.splitlines()[-1].split('|')[5].strip() == '-0.1000 (1 seed: ' \
        'no interval)'
