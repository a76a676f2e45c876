"""
Sparsity sweeps: routers x K x seeds, each a plain train.py run in out_dir/<name>/, tabulated with
each router's paired difference from topk (same seed = same initialisation and batches) in
out_dir/sweep.json and sweep.csv. Finished runs are reused and stopped ones (Ctrl-C, SIGTERM,
SIGHUP) resumed, only if made with the settings the sweep gives them now (--rerun_changed=True:
train them again); one sweep holds an out_dir at a time. finetune=True fine-tunes a TopK checkpoint
per seed with every router at every K, and adds training-free rows (that checkpoint evaluated with
each routing but mrltopk's, which is topk's); dense='active,total' adds dense GPTs (--moe_every=0)
of FFN width K*exp_dim and n_exp*exp_dim. A router may carry settings: `seqtopk+balance=bias`.

    python experiments/sweep.py experiments/config/sweep_cpu.py   # pretraining, with dense rows
    python experiments/sweep.py experiments/config/sweep_finetune_cpu.py  # the paper's Table 1
    python experiments/sweep.py --routers=topk,seqtopk --top_ks=4,2 --seeds=1,2,3 --max_iters=300
"""
import ast
import contextlib
import csv
import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the model's files

from checkpoint import code_version, in_use, lock, read_run, written
from configurator import (Rule, a_seed, check, configure, each, fail, non_empty, non_negative_int,
                          one_of, positive_int)
from model import GPTConfig
from router import ROUTERS
from compare import format_difference, last_done, markdown, mean_std, paired_difference

# -----------------------------------------------------------------------------
out_dir = 'sweeps/cpu'    # the sweep's folder: a folder per run, sweep.json and sweep.csv
routers = 'topk,seqtopk'  # topk first: the paired differences are against it
top_ks = '8,4,2'
seeds = '1,2,3'
max_iters = 1500
dense = ''                # dense rows (pretraining only): 'active', 'total' or 'active,total'
finetune = False          # pretrain TopK once per seed, then fine-tune every (router, K) from it
pretrain_k = 8
pretrain_iters = 1500
finetune_args = ''        # passed to the fine-tuning runs only (after train_args)
jobs = 1                  # runs at once; with more than one, each gets cpu_count // jobs threads
train_args = '--n_exp=32 --exp_dim=32 --eval_interval=500'  # passed to every train.py run
rerun_changed = False     # a finished or stopped run made with other settings: run it again
launcher = 'local'        # 'local': runs on this machine; 'slurm': a SLURM job per run (submitit)
slurm_partition = ''      # the jobs' partition ('': the cluster's default)
slurm_time = 240          # each job's time limit in minutes: a run past it is requeued, resumed
slurm_max_timeouts = 3    # time limits a run may reach (each requeued, resumed); one more: it fails
slurm_gpus = 1            # GPUs per job
slurm_cpus = 8            # CPUs per job
# -----------------------------------------------------------------------------


def router_of(variant):  # 'seqtopk+balance=bias' -> 'seqtopk'
    return variant.split('+')[0]


RULES = dict(out_dir=non_empty, routers=each(one_of(*ROUTERS), router_of),
             top_ks=each(positive_int, int), seeds=each(a_seed, int),
             max_iters=positive_int, pretrain_k=positive_int, pretrain_iters=positive_int,
             jobs=positive_int, launcher=one_of('local', 'slurm'), slurm_time=positive_int,
             slurm_max_timeouts=non_negative_int,
             slurm_gpus=non_negative_int, slurm_cpus=positive_int,
             dense=Rule(lambda v: v == '' or all(i in ('active', 'total') for i in v.split(',')),
                        "'' (none), 'active', 'total' or 'active,total'"))
TRAIN = os.path.join(ROOT, 'train.py')
LOCK = 'sweep.lock'  # in out_dir: held (flock) by the sweep that runs there
# settings that change no trained weight or evaluation: where and how a run starts and saves,
# what it logs where, how fast it computes the same model; runs that differ only in these are
# reused (sweep.py) and paired (analyze.py). Not eval_interval: the steps its log evaluates
IGNORED = {'out_dir', 'overwrite', 'init_from', 'always_save_checkpoint', 'log_interval',
           'wandb_log', 'wandb_project', 'wandb_run_name', 'compile', 'moe_impl'}
print_lock = threading.Lock()
running = set()  # how to stop each run under way
stopping = []    # why the sweep stops (a signal, a failed run), once something stopped it
fresh = set()    # run folders to train again from scratch (made with other settings)


def script_settings(path, args=(), dataclass=None):
    """The settings `python path args` would run with, checked by the script's own rules without
    running it, and its namespace: its code up to configure() (imports, settings block, rules),
    then configure(); else ValueError."""
    body = ast.parse(open(path).read(), path).body
    head = ast.Module(body[:next(i for i, node in enumerate(body)
                                 if 'configure(' in ast.unparse(node))], [])
    script = {'__name__': 'settings_of_' + os.path.basename(path), '__file__': path}
    exec(compile(head, path, 'exec'), script)
    try:
        return configure(script, list(args), script['RULES'], script.get('RELATIONS', ()),
                         dataclass)[0], script
    except SystemExit as e:  # its one line
        raise ValueError(str(e.code).removeprefix('error: ')) from None


def train_settings(args=None):
    """train.py's settings given train_args and a run's args (None: neither), checked as train.py
    checks them, its model's too; a run's --init_from, the sweep's own base, is left out: it may
    not exist yet, and has the sweep's model (as any checkpoint's model is not read here)."""
    settings, train = script_settings(TRAIN, [] if args is None else [
        *train_args.split(), *[a for a in args if not a.startswith('--init_from=')]], GPTConfig)
    model = {k: settings[k] for k in GPTConfig.__dataclass_fields__ if k in settings}
    GPTConfig(**model).validate()  # as train.py checks the model it builds
    check(dict(settings, **model), {}, train['MODEL_RELATIONS'])
    return settings


def say(line):  # a whole line, whichever thread says it
    with print_lock:
        print(line, flush=True)


def stop(why):
    """Every run under way stops (it saves), no new run starts; the sweep exits once they have."""
    if not stopping:
        stopping.append(why)
        for end in list(running):
            end()


def recorded(folder):
    """The run's settings (its start, else done record), base run and run_id; None: no log."""
    log = read_run(folder)
    if log is None:
        return None
    start = (log['start'] or [{}])[0]
    made = log['done'][-1] if log['done'] and 'config' in log['done'][-1] else start
    return dict(config=made.get('config'), from_run=made.get('from_run'),
                run_id=(log['done'] or [start])[-1].get('run_id'))


def changed(folder, now, base, defaults):
    """['setting old -> new', ...] between the run in folder and the settings it would train
    with now (and a base run trained again since); [] alike, None no run yet."""
    made = recorded(folder)
    if made is None or made['config'] is None and not os.path.exists(
            os.path.join(folder, 'ckpt.pt')):
        return None
    if made['config'] is None:
        return ['its log records no settings (made before runs recorded them)']
    old = made['config']
    diffs = [f"{k} {old[k]!r} -> {now.get(k)!r}" if k in old else f"{k} (new) {now[k]!r}"
             for k in sorted((set(old) | set(now)) - IGNORED)
             if old.get(k) != now.get(k) and (k in old or now[k] != defaults.get(k))]
    if base is not None and made['from_run'] != (recorded(base) or {}).get('run_id'):
        diffs.append(f"its base {os.path.basename(base)} was trained again since")
    return diffs


def ends_with(parent, prctl):
    """In train.py's process before it starts: SIGTERM (it saves, stops) when parent ends, even
    killed (PR_SET_PDEATHSIG: Linux); SLURM's warning, SIGUSR2, held: checkpoint() stops it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    if prctl:
        prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before that
        os._exit(1)


class Job:
    """A run's train.py, output to folder.out, resuming its ckpt.pt unless fresh (trained again, an
    evaluation). As a submitit job preempted or timed out: checkpoint(), then requeued, resumed."""

    def __init__(self, cmd, folder, fresh):
        self.cmd, self.folder, self.fresh, self.proc, self.stopped = cmd, folder, fresh, None, 0

    def command(self):
        resume = not self.fresh and os.path.exists(os.path.join(self.folder, 'ckpt.pt'))
        return [*[a for a in self.cmd if not (resume and a.startswith('--init_from='))],
                '--init_from=resume' if resume else '--overwrite=True']

    def __call__(self):  # train.py's exit status
        cmd, parent = self.command(), os.getpid()
        prctl = ctypes.CDLL(None).prctl if sys.platform == 'linux' else None
        in_slurm = os.environ.get('SUBMITIT_EXECUTOR') == 'slurm'  # this process is the job's
        if in_slurm:  # SLURM signals the batch script's process group: train.py has its own
            signal.signal(signal.SIGTERM, lambda *_: self.proc and self.proc.send_signal(15))
            if not self.fresh and self.last_event() == 'done':  # requeued as its run finished
                return 0
        with open(self.folder + '.out', 'a' if cmd[-1] == '--init_from=resume' else 'w') as log:
            self.proc = subprocess.Popen(  # a session of its own: Ctrl-C reaches it by stop()
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=lambda: ends_with(parent, prctl))
            if self.stopped:  # the sweep stopped while it started
                self.stop()
            code = self.proc.wait()
        if in_slurm and (code == 0 and self.last_event() == 'stopped' or code == -15):
            self.requeue()  # the cluster's SIGTERM (requeued, preempted), not the sweep's stop:
            # saved and stopped, or killed as it started (before train.py listens for it)
        return code

    def last_event(self):  # of the run's log (in a job the sweep's modules are not importable)
        with contextlib.suppress(OSError, ValueError, IndexError, KeyError):
            log = open(os.path.join(self.folder, 'log.jsonl')).read().splitlines()
            return json.loads(log[-1])['event']

    def requeue(self):
        """In a SLURM job whose train.py the cluster's SIGTERM stopped (or killed as it started):
        back in the queue, to resume the run (its time-outs counted as before). A job cancelled
        (by the sweep too) stays so: it ends with no result."""
        import submitit
        env = submitit.JobEnvironment()
        delayed = submitit.helpers.DelayedSubmission.load(env.paths.submitted_pickle)
        delayed.function = Job(self.cmd, self.folder, False)  # resumes, even a fresh run
        delayed.dump(env.paths.submitted_pickle)
        if slurm_state(env.job_id) != 'CANCELLED':  # scontrol would requeue a cancelled job too
            subprocess.run(['scontrol', 'requeue', env.job_id],  # refused if requeued already;
                           start_new_session=True)  # the requeue's SIGTERM must not stop it
        sys.exit(-1)  # not an Exception: submitit writes no result, its job is not done

    def stop(self):  # train.py saves after its step and exits
        self.stopped = 1
        if self.proc:
            self.proc.send_signal(signal.SIGTERM)

    def checkpoint(self):
        import submitit
        if self.proc:
            self.stop()
            with contextlib.suppress(ChildProcessError):  # not proc.wait(): the wait that this
                os.waitpid(self.proc.pid, 0)  # signal interrupted holds its lock
        if self.last_event() == 'done':  # the warning came as it finished: not requeued
            return None
        return submitit.helpers.DelayedSubmission(Job(self.cmd, self.folder, False))


def slurm_state(job_id):  # sacct's word for the job ('CANCELLED', 'RUNNING'...), '' if unknown
    return ''.join(subprocess.run(['sacct', '-X', '-n', '-o', 'State', '-j', job_id], text=True,
                                  capture_output=True, start_new_session=True).stdout.split()[:1])


def job_left(folder, executor, again):
    """The SLURM job (submitit's) that a sweep killed left running the run in folder, if it is
    still queued or running; None if none. A run to train again from scratch: cancelled first."""
    import submitit
    try:
        job_id = json.load(open(folder + '.job.json'))['job_id']
    except (OSError, ValueError, KeyError):
        return None
    job = submitit.SlurmJob(executor.folder, job_id)
    if job.done(force_check=True) or job.state == 'UNKNOWN':  # ended, or unknown to sacct
        return None
    if not again:
        return job
    job.cancel(check=False)
    job.wait()
    return None


def job_result(job):
    """train.py's exit status from a submitit job, else the exception it ended with. An end that
    SLURM took back, the job queued again (submitit's own requeue, its scontrol killed by the
    requeue's SIGTERM, leaves an error), is not its end: wait for the job again."""
    while True:
        error = job.exception()
        if error is None:
            return job.result()
        if slurm_state(job.job_id) not in ('PENDING', 'REQUEUED', 'REQUEUE_HOLD'):
            return error
        with contextlib.suppress(FileNotFoundError):
            os.remove(job.paths.result_pickle)
        job.watcher.clear()  # its cache holds the job as ended


def job_failure(error):
    """submitit's reason a job gave no result, in one line: the exception it raised (its trace's
    last line), else the state SLURM ended it in."""
    text = str(error)
    trace = text.split('-' * 22)
    if len(trace) > 2:  # FailedJobError: the job raised
        return trace[1].strip().splitlines()[-1]
    state = re.search(r'has not produced any output \(state: ([^)]*)\)', text)
    return f"ended with no result ({state[1]})" if state else ' '.join(text.split('\n')[:2])


def train(folder, args, number, executor):
    """Run train.py (executor: as a submitit job) unless folder holds a finished run, resuming a
    stopped one (no 'done' record); return its final record (None: the sweep is stopping)."""
    again, evaluation = folder in fresh, '--eval_only=True' in args
    if (again or last_done(folder, evaluation) is None) and not stopping:
        job = Job([sys.executable, TRAIN, *train_args.split(), *args, f'--out_dir={folder}'],
                  folder, again or evaluation)
        submitted = executor and job_left(folder, executor, again)
        if submitted:
            say(f"{number} waiting for job {submitted.job_id}, which a sweep killed left "
                f"training {folder}")
        else:
            say(f"{number} $ {' '.join(job.command()[1:])}")
        try:
            submitted = submitted or executor and executor.submit(job)
        except Exception as e:  # sbatch refused it: a partition the cluster lacks...
            stop('a job was refused')
            fail(f"submitit could not submit the run in {folder} ({e!r})")
        if executor:  # for the next sweep, if this one is killed
            with written(folder + '.job.json') as tmp, open(tmp, 'w') as f:
                json.dump(dict(job_id=submitted.job_id), f)
        end = (lambda: submitted.cancel(check=False)) if submitted else job.stop
        running.add(end)
        if stopping:  # the sweep stopped while it started
            end()
        # a job that ended without train.py's exit status (cancelled, killed...): its exception
        code = job_result(submitted) if submitted else job()
        running.discard(end)
        if stopping:
            return None
        failed = None  # a job's run that finished is done, whatever then ended the job
        if code != 0 and not (submitted and last_done(folder, evaluation)):
            lines = (open(folder + '.out', errors='replace').read().strip().splitlines()
                     if os.path.exists(folder + '.out') else [])
            why = next((line for line in reversed(lines) if line.startswith('error: ')),
                       f'job {submitted.job_id}: {job_failure(code)}'
                       if isinstance(code, Exception) else lines[-1] if lines
                       else f'exit status {code}')
            failed = f"the run in {folder} failed ({why.removeprefix('error: ')})"
        elif last_done(folder, evaluation) is None:
            failed = f"the run in {folder} exited without finishing (its log has no done record)"
        if failed:
            stop('a run failed')  # now: this thread's next run must not start
            fail(f"{failed}; see {folder}.out")
    return last_done(folder, evaluation)


def plan(ks, seed_list, router_list, settings):
    """The runs, seed-major, as (group, K, seed, name, args, after): group = (router, kind) names
    the table row (None: pretraining), after a run to finish first; settings: train.py's."""
    runs = [(None, pretrain_k, seed, f'pretrain-topk-k{pretrain_k}-s{seed}',
             ['--router=topk', f'--top_k={pretrain_k}', f'--seed={seed}',
              f'--max_iters={pretrain_iters}'], None) for seed in seed_list if finetune]
    for k in ks:
        groups = [(r, 'train') for r in router_list]
        if finetune:  # the pretrained TopK checkpoint evaluated with each routing, no training
            groups += [(r, 'training-free') for r in router_list if router_of(r) != 'mrltopk']
        for router, kind in groups:
            for seed in seed_list:
                name = (f"{'ft-' if finetune else ''}{router}-k{k}-s{seed}" +
                        ('-free' if kind != 'train' else ''))
                args = [f'--router={router_of(router)}', *[f'--{s}' for s in router.split('+')[1:]],
                        f'--top_k={k}', f'--seed={seed}', f'--max_iters={max_iters}']
                base = f'pretrain-topk-k{pretrain_k}-s{seed}' if finetune else None
                if base:
                    args.append(f"--init_from={os.path.join(out_dir, base, 'ckpt.pt')}")
                    args += finetune_args.split() if kind == 'train' else []
                if kind == 'training-free':
                    args.append('--eval_only=True')
                runs.append(((router, kind), k, seed, name, args, base))
    runs.sort(key=lambda run: run[0] is not None and run[2])  # pretraining first, then by seed
    for match in [m for m in dense.split(',') if m]:
        if settings['moe_every'] != 1:
            fail("dense rows replace every FFN, so they need a sweep of --moe_every=1 models")
        for k in (ks if match == 'active' else [None]):  # the total-parameter model has no K
            width = (k if match == 'active' else settings['n_exp']) * settings['exp_dim']
            for seed in seed_list:
                args = ['--moe_every=0', f'--mlp_dim={width}', f'--seed={seed}',
                        f'--max_iters={max_iters}']
                name = f"dense-{'active-k' + str(k) if k else 'total'}-s{seed}"
                runs.append((('dense', match), k, seed, name, args, None))
    return runs


def check_runs(runs):
    """Before the first run trains: each run's settings, checked as train.py checks them (one line
    names each run it would refuse), and a line per run in out_dir made with other settings than
    the sweep would give it now; then stop, or (--rerun_changed) train those again from scratch."""
    defaults, refused, stale = train_settings(), {}, set()
    for _, _, _, name, args, after in runs:  # in plan order: a base run before its fine-tunes
        folder, base = os.path.join(out_dir, name), after and os.path.join(out_dir, after)
        try:
            diffs = changed(folder, train_settings(args), base, defaults)
        except ValueError as e:
            refused.setdefault(str(e), []).append(name)
            continue
        if diffs or (base in stale and diffs is not None):
            stale.add(folder)
            why = '; '.join(diffs or ['its base reruns'])
            print(f"{folder} was made with other settings: {why}")
    if refused:
        fail(f"train.py would refuse {sum(map(len, refused.values()))} of the {len(runs)} runs, "
             f"so none ran: " + '; '.join(f"{', '.join(n)} ({why})" for why, n in refused.items()))
    if stale and not rerun_changed:
        fail(f"{len(stale)} run(s) in {out_dir} were made with other settings (above); run them "
             f"again with --rerun_changed=True, or give another --out_dir")
    fresh.update(stale)


def run_all(runs, executor):
    """Run the plan, `jobs` runs at once, saying each run's start, result and the time left; the
    first failure stops the sweep. Returns {name: final record}."""
    futures, finished, took, start = {}, {}, [], time.time()

    def one(i, name, args, after):
        if after is not None:
            futures[after].result()  # its checkpoint must exist first
        t0 = time.time()
        record = finished[name] = train(os.path.join(out_dir, name), args, f"[{i}/{len(runs)}]",
                                        executor)
        if record is not None:
            took.append(time.time() - t0)
            causal = record.get('val_ce_causal')
            left = len(runs) - len(finished)
            eta = np.mean(took) * left / min(jobs, max(1, left)) if left else 0
            say(f"[{i}/{len(runs)}] {name}: val ce {record['val_ce']:.4f}" +
                (f" (causal {causal:.4f})" if causal is not None else '') +
                f", {record['time']:.0f} s; {len(finished)} done, {left} to go" +
                (f", about {eta / 60:.0f} min left" if left else '') +
                f" ({(time.time() - start) / 60:.0f} min so far)")
        return name

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for i, (_, _, _, name, args, after) in enumerate(runs, 1):
            futures[name] = pool.submit(one, i, name, args, after)
        done, _ = wait(futures.values(), return_when=FIRST_EXCEPTION)
        failed = next((f.exception() for f in done if f.exception()), None)
        if failed is not None:  # at once: no new run starts, those under way stop, saved
            stop('a run failed')
            pool.shutdown(cancel_futures=True)
            raise failed
    if stopping:
        n = sum(record is not None for record in finished.values())
        raise SystemExit(f"{stopping[0]}: stopped the sweep with {n} of {len(runs)} runs "
                         f"finished; the runs under way saved their checkpoints. Run the same "
                         f"command again to finish it.")
    return finished


def rows_of(runs, finished, ks):
    """A row per (group, K) over its seeds, paired with topk's and with the dense FFN of the
    row's active parameters."""
    by_group = {}
    for group, k, seed, name, _, _ in runs:
        if group is not None:
            by_group.setdefault((group, k), {})[seed] = dict(finished[name], name=name)

    def offline(key):  # {seed: val CE, offline routing} of the group's runs at key
        return {s: f['val_ce_offline'] for s, f in by_group.get(key, {}).items()}
    rows, none = [], dict(mean=None, low=None, high=None, n=0)
    for k in ks:
        for group in [g for g, gk in by_group if gk == k] + [g for g, gk in by_group if gk is None]:
            key = (group, k) if (group, k) in by_group else (group, None)
            per_seed, (router, kind) = by_group[key], group
            finals = [per_seed[s] for s in sorted(per_seed)]
            causal = {s: f['val_ce_offline'] if f['val_ce_causal'] is None else f['val_ce_causal']
                      for s, f in per_seed.items()}
            ref = offline((('topk', 'train' if router == 'dense' else kind), k))
            d_off = paired_difference(offline(key), ref) if router != 'topk' else none
            d_causal = paired_difference(causal, ref) if router != 'topk' else none
            d_dense = (paired_difference(causal, offline((('dense', 'active'), k)))
                       if group != ('dense', 'active') else none)
            label = (f"dense, = {kind} params (FFN {finals[0]['mlp_dim']})" if router == 'dense'
                     else router + ('' if kind == 'train' else ' (training-free)') +
                     (' (fine-tuned)' if finetune and kind == 'train' else ''))
            offline_s, offline_mean = mean_std(offline(key).values())
            causal_s, causal_mean = mean_std([f['val_ce_causal'] for f in finals])
            rows.append(dict(
                row=label, router=router, kind=kind, K=k, seeds=len(finals),
                sparsity=f"{k}/{finals[0]['n_exp']}" if router != 'dense' else '',
                params=finals[0].get('params'), active_params=finals[0].get('active_params'),
                val_ce=offline_s, val_ce_mean=offline_mean, val_ce_causal=causal_s,
                val_ce_causal_mean=causal_mean, diff_vs_topk=d_off['mean'], diff_low=d_off['low'],
                diff_high=d_off['high'], diff_n=d_off['n'], diff_causal_vs_topk=d_causal['mean'],
                diff_causal_low=d_causal['low'], diff_causal_high=d_causal['high'],
                diff_vs_dense=d_dense['mean'], diff_dense_low=d_dense['low'],
                diff_dense_high=d_dense['high'],
                experts_per_token=mean_std([f.get('experts_mean') for f in finals])[1],
                experts_per_token_trained=mean_std([f.get('experts_trained') for f in finals])[1],
                wall_s=float(np.mean([f['time'] for f in finals]))))
    return rows


def print_table(rows, records):
    title = (f"Fine-tuning from TopK (K={pretrain_k}, {pretrain_iters} steps)" if finetune
             else "Pretraining")
    print(f"\n{title}: {max_iters} steps, seeds {seeds}, `{train_args}`" +
          (f", fine-tuning with `{finetune_args}`" if finetune and finetune_args else ''))
    made_at = dict(Counter(record.get('code') or 'unrecorded' for record in records))
    print("runs made at commit " + ', '.join(f"{c} ({n} runs)" for c, n in made_at.items()) +
          f"; this table at {code_version() or 'unknown'}")
    print("Δ = paired difference of final val cross-entropy from topk's at the same K and seed "
          "(same initialisation, batches and val batches; training-free rows: from topk "
          "training-free), mean over seeds [95% t-interval]; negative = lower than topk's\n")
    vs_dense = any(r['diff_vs_dense'] is not None for r in rows)
    if vs_dense:
        print("Δ vs dense: the same, from the dense FFN with the row's active parameters (causal "
              "routing)\n")

    def diff(r, mean, low, high):
        return format_difference(dict(mean=r[mean], low=r[low], high=r[high]))
    table = []
    for r in rows:
        params = (f"{r['params'] / 1e6:.2f}M ({r['active_params'] / 1e6:.2f}M)" if r['params']
                  else '')
        experts = f"{r['experts_per_token']:.2f}" if r['experts_per_token'] is not None else 'dense'
        trained = r['experts_per_token_trained']
        trained = (f"{trained:.2f}" if trained is not None
                   else 'dense' if r['router'] == 'dense' else '')
        table.append([r['row'], r['K'] or '', r['sparsity'], params, r['val_ce'],
                      r['val_ce_causal'] or 'same',
                      diff(r, 'diff_vs_topk', 'diff_low', 'diff_high'),
                      diff(r, 'diff_causal_vs_topk', 'diff_causal_low', 'diff_causal_high'),
                      *[diff(r, 'diff_vs_dense', 'diff_dense_low', 'diff_dense_high')] * vs_dense,
                      experts, trained, f"{r['wall_s']:.0f}"])
    markdown(['row', 'K', 'K/N', 'params (active)', 'val CE (offline routing)',
              'val CE (causal routing)', 'Δ vs topk (offline)', 'Δ vs topk (causal)',
              *['Δ vs dense, = active params'] * vs_dense, 'experts/token (eval)',
              'experts/token (training)', 'wall s/run'], table)
    return made_at


def main():
    configure(globals(), sys.argv[1:], RULES)
    ks, seed_list = [int(k) for k in top_ks.split(',')], [int(s) for s in seeds.split(',')]
    router_list = routers.split(',')
    if router_list[0] != 'topk':
        fail("--routers must start with topk: the paired differences are against it")
    if dense and finetune:
        fail("dense rows compare pretraining runs (a dense model has no routing to fine-tune)")
    try:
        runs = plan(ks, seed_list, router_list, train_settings([]))
    except ValueError as e:
        fail(f"--train_args: {e}")
    check_runs(runs)  # and the runs out_dir holds
    executor = None
    if launcher == 'slurm':  # a job per run; submitit is imported only here
        try:
            import submitit
            # the job's process is the batch script's (exec, no srun): srun turns a SIGTERM to
            # every process (scancel --full, a requeue) into SIGKILL before train.py can save
            executor = submitit.AutoExecutor(os.path.join(out_dir, 'slurm'), cluster='slurm',
                                             slurm_max_num_timeout=slurm_max_timeouts,
                                             slurm_python=f'exec {shlex.quote(sys.executable)}')
        except ImportError:
            fail("--launcher=slurm needs submitit: pip install submitit")
        except RuntimeError as e:  # not on a SLURM cluster
            fail(f"--launcher=slurm: {e}")
        executor.update_parameters(timeout_min=slurm_time, gpus_per_node=slurm_gpus,
                                   cpus_per_task=slurm_cpus,
                                   slurm_partition=slurm_partition or None, slurm_use_srun=False,
                                   # the warning (to the job's process) 90 s before the time
                                   # limit, or half way; SLURM may send it up to 60 s early:
                                   # ignored until submitit listens, never a kill
                                   slurm_setup=["trap '' USR2"], slurm_additional_parameters=dict(
                                       signal=f'B:USR2@{min(90, slurm_time * 30)}'))
    elif jobs > 1:  # share the cores: one run's threads should not contend with another's
        os.environ['OMP_NUM_THREADS'] = str(max(1, (os.cpu_count() or 1) // jobs))
    os.makedirs(out_dir, exist_ok=True)
    if not lock(os.path.join(out_dir, LOCK)):
        fail(f"--out_dir={out_dir} {in_use(os.path.join(out_dir, LOCK), 'sweep')}")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: its terminal closed
        signal.signal(sig, lambda signum, frame: stop(signal.Signals(signum).name))
    start = time.time()
    finished = run_all(runs, executor)
    rows = rows_of(runs, finished, ks)
    records = [dict(finished[name], name=name, kind=group[1] if group else 'pretrain', seed=seed)
               for group, _, seed, name, _, _ in runs]
    made_at = print_table(rows, records)
    with written(os.path.join(out_dir, 'sweep.json')) as tmp, open(tmp, 'w') as f:
        json.dump(dict(rows=rows, runs=records, code=code_version(), runs_code=made_at,
                       train_args=train_args, max_iters=max_iters, seeds=seeds,
                       finetune=finetune, pretrain_k=pretrain_k, pretrain_iters=pretrain_iters,
                       finetune_args=finetune_args, dense=dense), f, indent=2)
    with written(os.path.join(out_dir, 'sweep.csv')) as tmp, open(tmp, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nwrote {out_dir}/sweep.json and sweep.csv ({time.time() - start:.0f}s)")


if __name__ == '__main__':
    main()
