"""
Sparsity sweeps: routers x K x seeds, each run a plain train.py run in out_root/<name>/, tabulated
with every router's paired difference from topk (same seed = same initialisation and batches).

    python sweep.py config/sweep_cpu.py                 # pretraining, with dense rows
    python sweep.py config/sweep_finetune_cpu.py        # the paper's Table 1 protocol
    python sweep.py --routers=topk,seqtopk --top_ks=4,2 --seeds=1,2,3 --max_iters=300
    python sweep.py --routers=topk,topk+route_scale=1,seqtopk+balance=bias   # variants: a router and its settings

Finished runs are reused (a run counts as finished when its log.jsonl holds the 'done' record), so
an interrupted sweep picks up where it stopped: Ctrl-C or SIGTERM stops the runs under way as a
single run stops (they save), and the same command again resumes them. A run is reused or resumed
only if it was made with the settings the sweep would give it now (train_args, max_iters, the
code's defaults: what train.py resolves); otherwise the sweep says which settings differ and stops,
or with --rerun_changed=True runs it again from scratch. One sweep at a time holds an out_root
(sweep.lock). finetune=True pretrains TopK at K=pretrain_k once per
seed, fine-tunes that checkpoint with every router at every K, and adds "training-free" rows: the
TopK checkpoint evaluated with that routing and no training (mrltopk is left out there: its
evaluation is topk's). dense='active,total' adds dense GPTs (--moe_every=0) trained like the MoE
runs: FFN width K*exp_dim (the MoE's active parameters at each K) and n_exp*exp_dim (its total).
A router in `routers` may carry settings of its own, `router+key=value+...`: a row of its own, paired
with plain topk like the others.

Writes out_root/sweep.json (rows, per-run records) and out_root/sweep.csv (rows).
"""
import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from checkpoint import code_version, lock, lock_holder, read_log, written
from configurator import (Rule, configure, each, non_empty, non_negative_int, one_of, positive_int,
                          script_settings)
from router import ROUTERS
from stats import format_difference, mean_std, paired_difference

# -----------------------------------------------------------------------------
out_root = 'sweeps/cpu'
routers = 'topk,seqtopk'  # topk first: the paired differences are against it
top_ks = '8,4,2'
seeds = '1,2,3'
max_iters = 1500
dense = ''                # dense rows (pretraining only): 'active', 'total' or 'active,total'
finetune = False          # pretrain TopK once per seed, then fine-tune every (router, K) from it
pretrain_k = 8
pretrain_iters = 1500
finetune_args = ''        # passed to the fine-tuning runs only (after train_args), e.g. '--learning_rate=1e-3'
jobs = 1                  # runs at once; with more than one, each run gets cpu_count // jobs threads
train_args = '--n_exp=32 --exp_dim=32 --eval_interval=500'  # passed to every train.py run
rerun_changed = False     # a finished or stopped run made with other settings: run it again (or stop)
# -----------------------------------------------------------------------------
# what each setting may be (configurator.py), checked before anything runs; train.py checks train_args itself
RULES = dict(out_root=non_empty, routers=each(one_of(*ROUTERS), convert=lambda item: item.split('+')[0]),
             top_ks=each(positive_int, int),
             seeds=each(non_negative_int, int), max_iters=positive_int, pretrain_k=positive_int,
             pretrain_iters=positive_int, jobs=positive_int,
             dense=Rule(lambda v: v == '' or all(item in ('active', 'total') for item in v.split(',')),
                        "'' (none), 'active', 'total' or 'active,total'"))
HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, 'train.py')
LOCK = 'sweep.lock'  # in out_root: held (flock) by the sweep that runs there
print_lock = threading.Lock()
running = set()  # the train.py processes under way
stopping = []    # the signal that stops the sweep, once one came
fresh = set()    # out_dirs to train again from scratch (made with other settings)


def stop(signum, frame):
    """SIGTERM / SIGINT: every run under way stops as a single run does (it saves; a rerun resumes
    it), no new run starts, and the sweep exits once they have."""
    if not stopping:
        stopping.append(signal.Signals(signum).name)
        for proc in list(running):
            proc.send_signal(signal.SIGTERM)


def last_eval(out_dir, evaluation=False):
    """The final record of a finished training run (evaluation=True: of an evaluation, a
    training-free row's), or None: an evaluation is never taken for a training run."""
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        return None
    done = [r for r in read_log(path) if r.get('event') == 'done'
            and bool(r.get('eval_only')) == evaluation]
    return done[-1] if done else None


def recorded(out_dir):
    """What a run in out_dir was made with: its settings (its first start, else its done record),
    the run it was fine-tuned from, and its run_id (None where its log has none); None: no log."""
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        return None
    records = read_log(path)
    done = [r for r in records if r.get('event') == 'done']
    start = next((r for r in records if r.get('event') == 'start'), {})
    made = done[-1] if done and 'config' in done[-1] else start
    return dict(config=made.get('config'), from_run=made.get('from_run'),
                run_id=(done or [start])[-1].get('run_id'))


IGNORED = {'out_dir', 'overwrite', 'init_from'}  # where and how a run starts, not what it trains


def changed(out_dir, args, base, defaults):
    """How the run in out_dir differs from what args would train now ([] if alike, None if there
    is no run yet): 'setting old -> new' for each setting train.py would resolve otherwise (a
    setting its log lacks counts only if set away from its default), and a base run (fine-tuning)
    that is no longer the one it started from."""
    made = recorded(out_dir)
    if made is None or (made['config'] is None and not os.path.exists(
            os.path.join(out_dir, 'ckpt.pt'))):
        return None
    if made['config'] is None:
        return ['its log records no settings (made before runs recorded them)']
    now = script_settings(TRAIN, [*train_args.split(), *args])
    old = made['config']
    diffs = [f"{k} {old[k]!r} -> {now.get(k)!r}" if k in old else f"{k} (new) {now[k]!r}"
             for k in sorted((set(old) | set(now)) - IGNORED)
             if old.get(k) != now.get(k) and (k in old or now[k] != defaults.get(k))]
    if base is not None and made['from_run'] != (recorded(base) or {}).get('run_id'):
        diffs.append(f"its base {os.path.basename(base)} was trained again since")
    return diffs


def train(out_dir, *args):
    """Run train.py unless out_dir already holds a finished run, resuming one that was stopped
    (its ckpt.pt, no 'done' record); return its final record (None: the sweep is stopping)."""
    again, evaluation = out_dir in fresh, '--eval_only=True' in args
    if (again or last_eval(out_dir, evaluation) is None) and not stopping:
        resume = (not again and os.path.exists(os.path.join(out_dir, 'ckpt.pt'))
                  and '--eval_only=True' not in args)
        args = [a for a in args if not (resume and a.startswith('--init_from='))]
        cmd = [sys.executable, os.path.join(HERE, 'train.py'), *train_args.split(), *args,
               f'--out_dir={out_dir}', '--init_from=resume' if resume else '--overwrite=True']
        env = dict(os.environ)
        if jobs > 1:  # share the cores: one run's threads should not contend with the other's
            env['OMP_NUM_THREADS'] = str(max(1, (os.cpu_count() or 1) // jobs))
        with print_lock:
            print('$', ' '.join(cmd[1:]), flush=True)
        with open(out_dir + '.out', 'a' if resume else 'w') as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # Ctrl-C reaches it through stop()
            running.add(proc)
            if stopping:  # the signal came while it started
                proc.send_signal(signal.SIGTERM)
            proc.wait()
            running.discard(proc)
        if proc.returncode != 0 and not stopping:
            raise SystemExit(f"error: run failed, see {out_dir}.out")
        if last_eval(out_dir, evaluation) is None and not stopping:
            raise SystemExit(f"error: the run in {out_dir} exited without finishing (its log has "
                             f"no done record); see {out_dir}.out")
    return last_eval(out_dir, evaluation)


# -----------------------------------------------------------------------------

def router_of(variant):
    """The router of a row's variant: 'seqtopk+balance=bias' -> 'seqtopk'."""
    return variant.split('+')[0]


def plan(ks, seed_list, router_list, settings):
    """The runs of the sweep in the order they start: (group, K, seed, name, args, after).
    group = (router, kind) names the table row (None: a pretraining run); after is the name of a run
    that must finish first. Seed-major, so a seed's fine-tunes queue behind the other seeds' runs
    while its pretraining finishes. settings: what train.py resolves from train_args."""
    runs = []
    if finetune:
        for seed in seed_list:
            runs.append((None, pretrain_k, seed, f'pretrain-topk-k{pretrain_k}-s{seed}',
                         ['--router=topk', f'--top_k={pretrain_k}', f'--seed={seed}', f'--max_iters={pretrain_iters}'],
                         None))
    for k in ks:
        groups = [(r, 'train') for r in router_list]
        if finetune:  # the pretrained TopK checkpoint evaluated with each routing at this K, no training
            groups += [(r, 'training-free') for r in router_list if router_of(r) != 'mrltopk']
        for router, kind in groups:
            for seed in seed_list:
                name = f"{'ft-' if finetune else ''}{router}-k{k}-s{seed}" + ('-free' if kind != 'train' else '')
                args = [f'--router={router_of(router)}', *[f'--{s}' for s in router.split('+')[1:]], f'--top_k={k}',
                        f'--seed={seed}', f'--max_iters={max_iters}']
                base = f'pretrain-topk-k{pretrain_k}-s{seed}' if finetune else None
                if base:
                    args.append(f"--init_from={os.path.join(out_root, base, 'ckpt.pt')}")
                    args += finetune_args.split() if kind == 'train' else []
                if kind == 'training-free':
                    args.append('--eval_only=True')
                runs.append(((router, kind), k, seed, name, args, base))
    runs.sort(key=lambda run: run[0] is not None and run[2])  # pretraining first, then seed by seed
    for match in [m for m in dense.split(',') if m]:
        if settings['moe_every'] != 1:
            raise SystemExit("error: dense rows replace every FFN, so they need a sweep of --moe_every=1 models")
        for k in (ks if match == 'active' else [None]):  # the total-parameter dense model has no K
            width = (k if match == 'active' else settings['n_exp']) * settings['exp_dim']
            for seed in seed_list:
                args = ['--moe_every=0', f'--mlp_dim={width}', f'--seed={seed}', f'--max_iters={max_iters}']
                name = f"dense-{'active-k' + str(k) if k else 'total'}-s{seed}"
                runs.append((('dense', match), k, seed, name, args, None))
    return runs


def check_reuse(runs):
    """Each run already in out_root made with other settings than the sweep would give it now: one
    line each, then either stop (the default) or mark it to train again from scratch."""
    defaults = script_settings(TRAIN)
    stale = set()
    for _, _, _, name, args, after in runs:  # in plan order: a base run before its fine-tunes
        out_dir = os.path.join(out_root, name)
        diffs = changed(out_dir, args, os.path.join(out_root, after) if after else None, defaults)
        if diffs or (after and os.path.join(out_root, after) in stale and diffs is not None):
            stale.add(out_dir)
            print(f"{out_dir} was made with other settings: {'; '.join(diffs or ['its base reruns'])}")
    if stale and not rerun_changed:
        raise SystemExit(f"error: {len(stale)} run(s) in {out_root} were made with other settings "
                         f"(above); run them again with --rerun_changed=True, or give another --out_root")
    fresh.update(stale)


def run_all(runs):
    """Run the plan with `jobs` runs at once; returns {name: final record}."""
    futures, finished = {}, {}

    def one(name, args, after):
        if stopping:
            return name
        if after is not None:
            futures[after].result()  # its checkpoint must exist first
        finished[name] = train(os.path.join(out_root, name), *args)
        return name

    dataset = next((a.split('=', 1)[1] for a in train_args.split() if a.startswith('--dataset=')), 'shakespeare_char')
    if jobs > 1 and not os.path.exists(os.path.join('data', dataset, 'train.bin')):
        one(*runs[0][3:])  # alone: it prepares the data, which parallel runs would race to write
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for group, k, seed, name, args, after in runs:
            futures[name] = pool.submit(one, name, args, after)
        try:
            for future in futures.values():
                future.result()  # re-raise a failed run's error
        except BaseException:
            pool.shutdown(cancel_futures=True)  # the runs under way finish; no new one starts
            raise
    if stopping:
        done = sum(record is not None for record in finished.values())
        raise SystemExit(f"{stopping[0]}: stopped the sweep with {done} of {len(runs)} runs finished; the "
                         f"runs under way saved their checkpoints. Run the same command again to finish it.")
    return finished


def main():
    configure(globals(), sys.argv[1:], RULES)
    ks, seed_list, router_list = ([int(k) for k in top_ks.split(',')], [int(s) for s in seeds.split(',')],
                                  routers.split(','))
    if router_list[0] != 'topk':
        raise SystemExit("error: --routers must start with topk: the paired differences are against it")
    if dense and finetune:
        raise SystemExit("error: dense rows compare pretraining runs (a dense model has no routing to fine-tune)")
    os.makedirs(out_root, exist_ok=True)
    if not lock(os.path.join(out_root, LOCK)):
        raise SystemExit(f"error: --out_root={out_root} is in use by a live sweep "
                         f"({lock_holder(os.path.join(out_root, LOCK)) or 'just ended'}); wait for it "
                         f"to end or stop it, or give another --out_root")
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    start = time.time()
    runs = plan(ks, seed_list, router_list, script_settings(TRAIN, train_args.split()))
    check_reuse(runs)
    finished = run_all(runs)

    # rows: one per (group, K), its seeds' values side by side
    by_group = {}
    for group, k, seed, name, _, _ in runs:
        if group is not None:
            by_group.setdefault((group, k), {})[seed] = dict(finished[name], name=name)
    rows = []
    for k in ks:
        topk = {kind: by_group[(('topk', kind), k)] for kind in ('train', 'training-free')
                if (('topk', kind), k) in by_group}
        dense_active = by_group.get((('dense', 'active'), k))  # the comparison that matters: same active params
        groups = [g for (g, gk) in by_group if gk == k] + [g for (g, gk) in by_group if gk is None]
        for group in groups:
            per_seed = by_group[(group, k)] if (group, k) in by_group else by_group[(group, None)]
            router, kind = group
            finals = [per_seed[s] for s in sorted(per_seed)]
            offline = {s: f['val_ce_offline'] for s, f in per_seed.items()}
            causal = {s: f['val_ce_causal'] if f['val_ce_causal'] is not None else f['val_ce_offline']
                      for s, f in per_seed.items()}
            reference = topk.get('train' if router == 'dense' else kind)
            same = router == 'topk'
            d_off = paired_difference(offline, {s: f['val_ce_offline'] for s, f in reference.items()}) \
                if reference and not same else paired_difference({}, {})
            d_causal = paired_difference(causal, {s: f['val_ce_offline'] for s, f in reference.items()}) \
                if reference and not same else paired_difference({}, {})
            d_dense = paired_difference(causal, {s: f['val_ce_offline'] for s, f in dense_active.items()}) \
                if dense_active and group != ('dense', 'active') else paired_difference({}, {})
            label = ({'active': f'dense, = active params (FFN {finals[0]["mlp_dim"]})',
                      'total': f'dense, = total params (FFN {finals[0]["mlp_dim"]})'}[kind] if router == 'dense'
                     else router + ('' if kind == 'train' else ' (training-free)') +
                     (' (fine-tuned)' if finetune and kind == 'train' else ''))
            offline_s, offline_mean = mean_std(offline.values())
            causal_s, causal_mean = mean_std([f['val_ce_causal'] for f in finals])
            experts = [f['experts_mean'] for f in finals if f.get('experts_mean') is not None]
            trained = [f['experts_trained'] for f in finals if f.get('experts_trained') is not None]
            rows.append(dict(
                row=label, router=router, kind=kind, K=k, sparsity=f"{k}/{finals[0]['n_exp']}" if router != 'dense' else '',
                seeds=len(finals), params=finals[0].get('params'), active_params=finals[0].get('active_params'),
                val_ce=offline_s, val_ce_mean=offline_mean, val_ce_causal=causal_s, val_ce_causal_mean=causal_mean,
                diff_vs_topk=d_off['mean'], diff_low=d_off['low'], diff_high=d_off['high'], diff_n=d_off['n'],
                diff_causal_vs_topk=d_causal['mean'], diff_causal_low=d_causal['low'],
                diff_causal_high=d_causal['high'],
                diff_vs_dense=d_dense['mean'], diff_dense_low=d_dense['low'], diff_dense_high=d_dense['high'],
                experts_per_token=float(np.mean(experts)) if experts else None,
                experts_per_token_trained=float(np.mean(trained)) if trained else None,
                wall_s=float(np.mean([f['time'] for f in finals]))))
    records = [dict(finished[name], name=name, kind=group[1] if group else 'pretrain', seed=seed)
               for group, _, seed, name, _, _ in runs]

    title = (f"Fine-tuning from TopK (K={pretrain_k}, {pretrain_iters} steps)" if finetune else "Pretraining")
    print(f"\n{title}: {max_iters} steps, seeds {seeds}, `{train_args}`" +
          (f", fine-tuning with `{finetune_args}`" if finetune and finetune_args else ''))
    made_at = dict(Counter(record.get('code') or 'unrecorded' for record in records))
    print("runs made at commit " + ', '.join(f"{c} ({n} runs)" for c, n in made_at.items()) +
          f"; this table at {code_version() or 'unknown'}")
    print("Δ = paired difference of final val cross-entropy from topk's at the same K and seed (same "
          "initialisation, batches and val batches; training-free rows: from topk training-free), mean over "
          "seeds [95% t-interval]; negative = lower than topk's\n")
    vs_dense = any(r['diff_vs_dense'] is not None for r in rows)
    if vs_dense:
        print("Δ vs dense: the same, from the dense FFN with the row's active parameters (causal routing)\n")
    print("| row | K | K/N | params (active) | val CE (offline routing) | val CE (causal routing) "
          "| Δ vs topk (offline) | Δ vs topk (causal) " + ("| Δ vs dense, = active params " if vs_dense else "") +
          "| experts/token (eval) | experts/token (training) | wall s/run |")
    print("| --- " * (11 + vs_dense) + "|")
    for r in rows:
        params = f"{r['params'] / 1e6:.2f}M ({r['active_params'] / 1e6:.2f}M)" if r['params'] else ''
        experts = f"{r['experts_per_token']:.2f}" if r['experts_per_token'] is not None else 'dense'
        trained = f"{r['experts_per_token_trained']:.2f}" if r['experts_per_token_trained'] is not None else ''
        print(f"| {r['row']} | {r['K'] or ''} | {r['sparsity']} | {params} | {r['val_ce']} "
              f"| {r['val_ce_causal'] or 'same'} "
              f"| {format_difference(dict(mean=r['diff_vs_topk'], low=r['diff_low'], high=r['diff_high']))} "
              f"| {format_difference(dict(mean=r['diff_causal_vs_topk'], low=r['diff_causal_low'], high=r['diff_causal_high']))} "
              + (f"| {format_difference(dict(mean=r['diff_vs_dense'], low=r['diff_dense_low'], high=r['diff_dense_high']))} "
                 if vs_dense else '') +
              f"| {experts} | {trained or ('' if r['router'] != 'dense' else 'dense')} | {r['wall_s']:.0f} |")
    with written(os.path.join(out_root, 'sweep.json')) as tmp, open(tmp, 'w') as f:  # never half-written
        json.dump(dict(rows=rows, runs=records, code=code_version(), runs_code=made_at,
                       train_args=train_args, max_iters=max_iters, seeds=seeds,
                       finetune=finetune, pretrain_k=pretrain_k, pretrain_iters=pretrain_iters,
                       finetune_args=finetune_args, dense=dense), f, indent=2)
    with written(os.path.join(out_root, 'sweep.csv')) as tmp, open(tmp, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nwrote {out_root}/sweep.json and sweep.csv ({time.time() - start:.0f}s)")


if __name__ == '__main__':
    main()
