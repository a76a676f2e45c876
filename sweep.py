"""
Sparsity sweeps: routers x top_k x seeds on the same data, model and step budget, as in the paper's
Table 1. Each run is a plain `python train.py ...` in its own out_dir; finished runs are skipped,
so an interrupted sweep continues where it stopped.

    python sweep.py config/sweep_cpu.py              # pretraining sweep, about an hour on 2 CPU cores
    python sweep.py config/sweep_finetune_cpu.py     # pretrain TopK once, fine-tune it at each K
    python sweep.py config/sweep_gpu.py

Prints a Markdown table (router, K, K/N, val cross-entropy mean +- std over seeds with offline and
causal routing, experts per token, wall time) and writes sweep.json / sweep.csv into out_root.
With finetune=True the sweep first pretrains one TopK model (pretrain_k, pretrain_iters) and every
run starts from it (train.py --init_from=<its checkpoint>); the table then also has "training-free"
rows per router and K: the TopK checkpoint evaluated with that routing and no training.
"""
import csv
import json
import os
import subprocess
import sys
import time

import numpy as np

from configurator import apply_overrides, each, non_empty, non_negative_int, one_of, positive_int, validate
from router import ROUTERS

# -----------------------------------------------------------------------------
out_root = 'sweeps/cpu'
routers = 'topk,seqtopk'
top_ks = '8,4,2'
seeds = '1,2'
max_iters = 1500
finetune = False          # pretrain TopK once, then fine-tune every (router, K) from it
pretrain_k = 8
pretrain_iters = 1500
train_args = '--n_exp=32 --exp_dim=32 --eval_interval=500'  # passed to every train.py run
# -----------------------------------------------------------------------------
# what each setting may be (configurator.py), checked before anything runs; train.py checks train_args itself
RULES = dict(out_root=non_empty, routers=each(one_of(*ROUTERS)), top_ks=each(positive_int, int),
             seeds=each(non_negative_int, int), max_iters=positive_int, pretrain_k=positive_int,
             pretrain_iters=positive_int)
apply_overrides(globals(), sys.argv[1:])
validate({k: v for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))},
         RULES)
HERE = os.path.dirname(os.path.abspath(__file__))


def last_eval(out_dir):
    """The final eval record of a finished run, or None."""
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        return None
    records = [json.loads(line) for line in open(path)]
    done = [r for r in records if r.get('event') == 'done']
    return done[-1] if done else None


def train(out_dir, *args):
    """Run train.py unless out_dir already holds a finished run; return its final record."""
    if last_eval(out_dir) is None:
        cmd = [sys.executable, os.path.join(HERE, 'train.py'), *train_args.split(), *args,
               f'--out_dir={out_dir}', '--overwrite=True']
        print('$', ' '.join(cmd[1:]), flush=True)
        with open(out_dir + '.out', 'w') as log:
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise SystemExit(f"error: run failed, see {out_dir}.out")
    return last_eval(out_dir)


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return '', None
    return (f"{np.mean(values):.4f} ± {np.std(values):.4f}" if len(values) > 1 else f"{values[0]:.4f}"), \
        float(np.mean(values))


def main():
    os.makedirs(out_root, exist_ok=True)
    start = time.time()
    rows, runs = [], []
    base = None
    if finetune:
        base_dir = os.path.join(out_root, f'pretrain-topk-k{pretrain_k}')
        train(base_dir, '--router=topk', f'--top_k={pretrain_k}', f'--max_iters={pretrain_iters}')
        base = os.path.join(base_dir, 'ckpt.pt')
    for k in [int(k) for k in top_ks.split(',')]:
        kinds = [(r, 'train') for r in routers.split(',')]
        if finetune:  # the pretrained TopK checkpoint evaluated with each router at this K, no training
            kinds += [(r, 'training-free') for r in routers.split(',')]
        for router, kind in kinds:
            finals = []
            for seed in [int(s) for s in seeds.split(',')]:
                name = f"{'ft-' if finetune else ''}{router}-k{k}-s{seed}" + ('-free' if kind != 'train' else '')
                args = [f'--router={router}', f'--top_k={k}', f'--seed={seed}', f'--max_iters={max_iters}']
                if finetune:
                    args.append(f'--init_from={base}')
                if kind == 'training-free':
                    args.append('--eval_only=True')
                final = train(os.path.join(out_root, name), *args)
                runs.append(dict(final, name=name, kind=kind, seed=seed))
                finals.append(final)
            n_exp = finals[0]['n_exp']
            offline, offline_mean = mean_std([f['val_ce_offline'] for f in finals])
            causal, causal_mean = mean_std([f.get('val_ce_causal') for f in finals])
            rows.append(dict(router=router + ('' if kind == 'train' else ' (training-free)'), K=k,
                             sparsity=f"{k}/{n_exp}", val_ce=offline, val_ce_mean=offline_mean,
                             val_ce_causal=causal, val_ce_causal_mean=causal_mean,
                             experts_per_token=float(np.mean([f['experts_mean'] for f in finals])),
                             wall_s=float(np.mean([f['time'] for f in finals]))))
    print(f"\n{'Fine-tuning from TopK (K=' + str(pretrain_k) + ')' if finetune else 'Pretraining'}: "
          f"{max_iters} steps, seeds {seeds}, `{train_args}`\n")
    print("| router | K | K/N | val CE (offline routing) | val CE (causal routing) | experts/token | wall s/run |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['router']} | {r['K']} | {r['sparsity']} | {r['val_ce']} | {r['val_ce_causal'] or 'same'} "
              f"| {r['experts_per_token']:.2f} | {r['wall_s']:.0f} |")
    with open(os.path.join(out_root, 'sweep.json'), 'w') as f:
        json.dump(dict(rows=rows, runs=runs, train_args=train_args, max_iters=max_iters, seeds=seeds,
                       finetune=finetune), f, indent=2)
    with open(os.path.join(out_root, 'sweep.csv'), 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nwrote {out_root}/sweep.json and sweep.csv ({time.time() - start:.0f}s)")


if __name__ == '__main__':
    main()
