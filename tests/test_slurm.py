"""
experiments/sweep.py --launcher=slurm on a real one-node SLURM (Debian's slurmctld, slurmd,
slurmdbd on MariaDB, munge; .ci/run installs them), started here as root on localhost, and what a
cluster does to its jobs: requeued, preempted, SIGTERM to every process, the warning before the
time limit, the time limit, a job that fails, the sweep killed. Skipped where it cannot start.
"""
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from filelock import FileLock

from conftest import HANG, OFFLINE_ENV, REPO, TINY

pytestmark = [pytest.mark.slurm, pytest.mark.long]

# the node claims more CPUs than the machine has (config_overrides): every scenario's one-thread
# jobs run at once; a job of them all (partition high) preempts those on debug
CPUS = 16
SLURM_CONF = """\
ClusterName=lab
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort={dbd_port}
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/d
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
MinJobAge=600
KillWait=30
MailProg=/bin/true
NodeName=localhost CPUs={cpus} RealMemory=1000 State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP PriorityTier=1 \
PreemptMode=REQUEUE GraceTime=0
PartitionName=high Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""
SLURMDBD_CONF = """\
AuthType=auth/munge
DbdHost=localhost
DbdPort={dbd_port}
SlurmUser=root
LogFile={root}/slurmdbd.log
PidFile={root}/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=seqmoe_slurm_acct
"""
PIDS = ('slurmd', 'slurmctld', 'slurmdbd', 'mariadbd', 'munged')  # stopped in this order


def until(ready, seconds, what):
    """Wait for ready() (true), at most seconds; else RuntimeError naming what."""
    deadline = time.time() + seconds
    while not (result := ready()):
        if time.time() > deadline:
            raise RuntimeError(f"{what} not ready after {seconds} s")
        time.sleep(0.5)
    return result


def ok(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True).returncode == 0


def start_cluster(root):
    """munged, MariaDB, slurmdbd, slurmctld and slurmd -N localhost, as root, their files and pid
    files in root; RuntimeError if one does not start."""
    if os.geteuid() != 0 or not all(map(shutil.which, ('sbatch', 'slurmctld', 'mariadbd'))):
        raise RuntimeError("needs root and Debian's slurmctld, slurmd, slurmdbd, munge, "
                           "mariadb-server (.ci/run installs them)")
    ports = dict(dbd_port=16819, ctld_port=16817, d_port=16818)
    (root / 'slurm.conf').write_text(SLURM_CONF.format(root=root, cpus=CPUS, **ports))
    (root / 'slurmdbd.conf').write_text(SLURMDBD_CONF.format(root=root, **ports))
    (root / 'slurmdbd.conf').chmod(0o600)
    os.environ['SLURM_CONF'] = str(root / 'slurm.conf')  # every SLURM command reads it
    if not ok('munge', '-n'):  # no munged running: ours
        os.makedirs('/run/munge', exist_ok=True)
        shutil.chown('/run/munge', 'munge', 'munge')
        subprocess.run(['runuser', '-u', 'munge', '--', 'munged'], check=True)
        until(lambda: ok('munge', '-n'), 30, 'munged')
        shutil.copy('/run/munge/munged.pid', root)  # its own, which root cannot write in
    os.makedirs('/run/mysqld', exist_ok=True)
    shutil.chown('/run/mysqld', 'mysql', 'mysql')
    mariadb = subprocess.Popen(['mariadbd', '--user=mysql', '--skip-networking'],
                               stdout=open(root / 'mariadb.log', 'w'), stderr=subprocess.STDOUT,
                               start_new_session=True)
    (root / 'mariadbd.pid').write_text(str(mariadb.pid))
    until(lambda: ok('mysql', '-u', 'root', '-e', 'DROP DATABASE IF EXISTS seqmoe_slurm_acct'),
          60, 'MariaDB')  # a fresh database: job ids start at 1 again
    subprocess.run(['slurmdbd'], check=True)
    until(lambda: ok('sacctmgr', '-i', 'add', 'cluster', 'lab'), 60, 'slurmdbd')
    (root / 'ctld').mkdir()
    (root / 'd').mkdir()
    subprocess.run(['slurmctld', '-c'], check=True)
    subprocess.run(['slurmd', '-N', 'localhost'], check=True)
    until(lambda: subprocess.run(['sinfo', '-h', '-o', '%t'], capture_output=True,
                                 text=True).stdout.split() == ['idle'], 60, 'the node')


def stop_cluster(root):
    """Each daemon this fixture started, by the pid it wrote, then wait until they are gone."""
    pids = []
    for name in PIDS:
        with contextlib.suppress(OSError, ValueError):
            pids.append(int((root / f'{name}.pid').read_text()))
            os.kill(pids[-1], signal.SIGTERM)
    with contextlib.suppress(RuntimeError):
        until(lambda: not any(map(alive, pids)), 30, 'daemons')


def alive(pid):  # neither gone nor a zombie (MariaDB's, until the process that started it ends)
    with contextlib.suppress(OSError):
        return open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z'
    return False


@pytest.fixture(scope='session')
def cluster(tmp_path_factory):
    """A one-node SLURM for this session's slurm tests, started by the first pytest-xdist worker
    that needs it, stopped by the last one done with it (a count of its users); skips if it
    cannot start."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get('PYTEST_XDIST_WORKER'):
        root = root.parent
    root = root / 'slurm'
    users = root.parent / 'slurm.users'
    with FileLock(str(root.parent / 'slurm.lock')):
        if not users.exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            t0 = time.time()
            try:
                start_cluster(root)
            except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
                stop_cluster(root)
                (root / 'failed').write_text(str(e))
            print(f"the cluster started in {time.time() - t0:.0f} s")
            users.write_text('0')
        if (root / 'failed').exists():
            pytest.skip(f"no SLURM cluster: {(root / 'failed').read_text()}")
        os.environ['SLURM_CONF'] = str(root / 'slurm.conf')
        users.write_text(str(int(users.read_text()) + 1))
    yield root
    with FileLock(str(root.parent / 'slurm.lock')):
        left = int(users.read_text()) - 1
        users.write_text(str(left))
        if not left:
            stop_cluster(root)
            users.unlink()


# -----------------------------------------------------------------------------
# sweeps of two tiny one-thread runs, and what the cluster does to their jobs

def sweep_args(out_dir, max_iters, *extra):
    return [f'--out_dir={out_dir}', '--routers=topk,seqtopk', '--top_ks=2', '--seeds=1',
            f'--max_iters={max_iters}', '--jobs=2', '--launcher=slurm', '--slurm_gpus=0',
            '--slurm_cpus=1', *extra,
            f'--train_args={TINY} --n_exp=4 --eval_interval=1000 --log_interval=1']


def start_sweep(workdir, args):
    env = dict(OFFLINE_ENV, SLURM_CONF=os.environ['SLURM_CONF'], OMP_NUM_THREADS='1')
    return subprocess.Popen([sys.executable, os.path.join(REPO, 'experiments', 'sweep.py'), *args],
                            cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def records(run):
    log = run / 'log.jsonl'
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def training(run):  # its job's train.py has trained a step: its job id
    if any(r['event'] == 'train' for r in records(run)):
        return json.load(open(f'{run}.job.json'))['job_id']


def finished_once(run, max_iters, stops):
    """The run finished once, stopped (and saved) `stops` times on the way, each step once:
    resumed from its checkpoint each time, never from scratch."""
    events = [r['event'] for r in records(run)]
    assert events.count('done') == 1 and events.count('start') == 1, (run, events)
    assert events.count('stopped') in stops, (run, events)
    assert [r['iter'] for r in records(run) if r['event'] == 'train'] == \
        list(range(1, max_iters + 1)), run


def releasing(stop):
    """As root, start the jobs SLURM holds after a requeue (pending about 2 minutes, reason
    BeginTime) 5 s after, until stop is set: the tests need not wait. (At once, slurmd refuses the
    job: its credential was revoked by the requeue that same second.)"""
    seen = {}
    while not stop.wait(1):
        held = subprocess.run(['squeue', '-h', '-t', 'PD', '-o', '%i %r'], capture_output=True,
                              text=True).stdout.split('\n')
        for job in (line.split()[0] for line in held if line.endswith('BeginTime')):
            if time.time() - seen.setdefault(job, time.time()) > 5:
                subprocess.run(['scontrol', 'update', f'jobid={job}', 'starttime=now'],
                               capture_output=True)
                del seen[job]


@contextlib.contextmanager
def cluster_for_this_test(root):
    """The cluster to this test alone (a test of another pytest-xdist worker waits: a preemption
    takes every CPU), held jobs released, and nothing left in squeue at the end."""
    stop = threading.Event()
    with FileLock(str(root / 'busy.lock')):
        releaser = threading.Thread(target=releasing, args=(stop,), daemon=True)
        releaser.start()
        left = lambda: subprocess.run(['squeue', '-h'], capture_output=True, text=True).stdout
        try:
            yield
            with contextlib.suppress(RuntimeError):
                until(lambda: not left(), 60, 'squeue empty')
        finally:
            stop.set()
            releaser.join()
        assert not left(), left()


def acted(workdir, name, max_iters, act, *extra):
    """A sweep in workdir/name; act(job id, sweep) once its topk run trains (an act whose
    `from_start` is set: act(None, sweep) at once); its process, ended (its stdout and stderr in
    .out, .err)."""
    started = start_sweep(workdir, sweep_args(name, max_iters, *extra))
    run = workdir / name / 'topk-k2-s1'
    job = None if getattr(act, 'from_start', False) else until(
        lambda: training(run) or started.poll() is not None, HANG, f'{name}: training')
    if job is not True:
        act(job, started)
    started.out, started.err = started.communicate(timeout=HANG)
    return started


def ends_finished(workdir, name, max_iters, act, stops, *extra, seqtopk_stops=(0,)):
    """The sweep ends well, each run finished once: topk's stopped `stops` times, seqtopk's
    `seqtopk_stops`."""
    started = acted(workdir, name, max_iters, act, *extra)
    assert started.returncode == 0, started.err
    finished_once(workdir / name / 'topk-k2-s1', max_iters, stops)
    finished_once(workdir / name / 'seqtopk-k2-s1', max_iters, seqtopk_stops)


def scontrol(*args):
    subprocess.run(['scontrol', *args], check=True)


def scancel(*args):
    subprocess.run(['scancel', *args], check=True)


def mid_run(workdir, name, act, *runs):
    """act(job, sweep) with train.py paused (SIGSTOP) until what act does reaches it (it runs
    again, or a SIGTERM waits for it): topk's at once, each of runs' once it trains. Mid-run
    however fast the machine, and with few steps."""
    def paused(job, sweep):
        pids = []
        for run in ('topk-k2-s1', *runs):
            until(lambda: training(workdir / name / run), HANG, f'{name}/{run}: training')
            pids += processes(f'--out_dir={name}/{run}')
            send(pids, signal.SIGSTOP)
            assert records(workdir / name / run)[-1]['event'] != 'done', run
        try:
            act(job, sweep)
            until(lambda: all(map(reached, pids)), HANG, f'{name}: the signal')
        finally:
            send(pids, signal.SIGCONT)
    return paused


def reached(pid):  # a paused process runs again, or a SIGTERM waits for it, or it ended
    with contextlib.suppress(OSError):
        status = dict(line.split(':\t', 1) for line in open(f'/proc/{pid}/status').read()
                      .splitlines() if ':\t' in line)
        waiting = int(status['SigPnd'], 16) | int(status['ShdPnd'], 16)
        return status['State'][0] != 'T' or bool(waiting >> (signal.SIGTERM - 1) & 1)
    return True


def requeued(workdir):  # as a preemption with PreemptMode=REQUEUE does it
    ends_finished(workdir, 'requeued', 100,
                  mid_run(workdir, 'requeued', lambda job, _: scontrol('requeue', job)), (1,))


def term_to_every_process(workdir):  # the batch script, submitit's process and train.py
    ends_finished(workdir, 'term_full', 100, mid_run(
        workdir, 'term_full', lambda job, _: scancel('--signal=TERM', '--full', job)), (1,))


def warned_before_its_time_limit(workdir):  # SLURM's --signal=B:USR2@90, sent now
    ends_finished(workdir, 'usr2', 100, mid_run(
        workdir, 'usr2', lambda job, _: scancel('--batch', '--signal=USR2', job)), (1,))


def warned(workdir, name, *runs):
    """An act from the sweep's start: each run paused (SIGSTOP) from its first step until SLURM's
    warning before the time limit reaches that start of its job. Runs longer than their time
    limit on any machine: slurmctld checks time limits every 30 s, time enough for a tiny run to
    finish, or to be warned before its first step (its train.py killed as it starts, started
    again)."""
    def act(_, sweep):
        paused = {}

        def each_warned():
            for run in runs:
                if run not in paused and (job := training(workdir / name / run)):
                    pids = processes(f'--out_dir={name}/{run}')
                    send(pids, signal.SIGSTOP)
                    assert records(workdir / name / run)[-1]['event'] != 'done', run
                    paused[run] = workdir / name / 'slurm' / f'{job}_0_log.out', pids
            warned = set()
            for run, (log, pids) in paused.items():  # each start of a job, warned once
                said = log.read_text()
                if said.count('Caught signal SIGUSR2') >= said.count('Starting with'):
                    send(pids, signal.SIGCONT)
                    warned.add(run)
            return warned == set(runs) or sweep.poll() is not None
        try:
            until(each_warned, HANG, f'{name}: the warnings')
        finally:
            send([pid for _, pids in paused.values() for pid in pids], signal.SIGCONT)
    act.from_start = True
    return act


def send(pids, sig):
    for pid in pids:
        with contextlib.suppress(OSError):  # ended meanwhile
            os.kill(pid, sig)


def past_its_time_limit(workdir):  # warned when less than 90 s are left: at once, each start
    ends_finished(workdir, 'time_limit', 100, warned(workdir, 'time_limit', 'topk-k2-s1',
                                                     'seqtopk-k2-s1'), range(1, 10),
                  '--slurm_time=1', '--slurm_max_timeouts=9', seqtopk_stops=range(1, 10))


def sweep_to_the_end(workdir):
    ends_finished(workdir, 'to_the_end', 20, lambda job, _: None, (0,))


def fails(workdir, name, stopped, why, *extra):
    """The sweep exits 1 with one line naming the run that failed and why; the other run
    stopped (saved), finished first, or had not started."""
    started = acted(workdir, name, 100, stopped, *extra)
    assert started.returncode == 1, started.err
    assert re.fullmatch(rf'error: the run in {name}/\S+ failed \(job \d+: {why}\); see \S+\.out',
                        started.err.strip().splitlines()[-1]), started.err
    # the other run's job, cancelled as the sweep stopped, may still be saving: its log once done
    until(lambda: not processes(f'--out_dir={name}/'), HANG, f'{name}: its runs to end')
    for run in ('topk-k2-s1', 'seqtopk-k2-s1'):
        assert [r['event'] for r in records(workdir / name / run)][-1:] in (
            [], ['stopped'], ['done'])


def processes(needle):
    """The pids of the processes whose command line holds needle."""
    pids = []
    for cmdline in glob.glob('/proc/[0-9]*/cmdline'):
        with contextlib.suppress(OSError):  # a process that ended meanwhile
            if needle in open(cmdline).read().replace('\0', ' '):
                pids.append(int(cmdline.split('/')[2]))
    return pids


def a_job_fails(workdir):  # its process killed (by the kernel's OOM killer, say)
    def kill_job(job, _):  # train.py's parent
        for pid in processes('--out_dir=a_job_fails/topk-k2-s1'):
            with contextlib.suppress(OSError):
                stat = open(f'/proc/{pid}/stat').read()
                return os.kill(int(stat.rsplit(')', 1)[1].split()[1]), signal.SIGKILL)
    fails(workdir, 'a_job_fails', mid_run(workdir, 'a_job_fails', kill_job),
          r'ended with no result \(FAILED\)')


def past_its_time_limit_once_too_often(workdir):
    fails(workdir, 'timed_out', warned(workdir, 'timed_out', 'topk-k2-s1'),
          r'submitit\S*UncompletedJobError: Job not requeued because: timed-out too many times\.',
          '--slurm_time=1', '--slurm_max_timeouts=0')


def killed_and_run_again(workdir):  # the same command finds the jobs the killed sweep left
    def kill(job, sweep):  # once both runs train: stopped (SIGSTOP: they cannot end meanwhile,
        # their jobs still RUNNING to SLURM), the sweep killed
        send(processes('--out_dir=killed/topk-k2-s1'), signal.SIGSTOP)
        until(lambda: training(workdir / 'killed' / 'seqtopk-k2-s1'), HANG, 'seqtopk')
        send(processes('--out_dir=killed/'), signal.SIGSTOP)
        sweep.kill()
    acted(workdir, 'killed', 100, kill)
    again = start_sweep(workdir, sweep_args('killed', 100))
    said = []
    while len([line for line in said if 'waiting for job ' in line]) < 2:
        said.append(again.stdout.readline())
        if not said[-1] or ' $ ' in said[-1]:  # it ended, or submitted a job again
            break
    send(processes('--out_dir=killed/'), signal.SIGCONT)
    out, err = again.communicate(timeout=HANG)
    out = ''.join(said) + out
    assert again.returncode == 0, err
    assert out.count('waiting for job ') == 2 and ' $ ' not in out, out  # nothing submitted
    for run in ('topk-k2-s1', 'seqtopk-k2-s1'):
        finished_once(workdir / 'killed' / run, 100, (0,))


SCENARIOS = [sweep_to_the_end, requeued, term_to_every_process, warned_before_its_time_limit,
             past_its_time_limit, a_job_fails, past_its_time_limit_once_too_often,
             killed_and_run_again]


def test_a_slurm_sweep_finishes_each_run_once_whatever_the_cluster_does_to_its_jobs(cluster,
                                                                                     workdir):
    with cluster_for_this_test(cluster), ThreadPoolExecutor(len(SCENARIOS)) as pool:
        t0 = time.time()
        futures = {s.__name__: pool.submit(s, workdir) for s in SCENARIOS}
        for future in futures.values():  # each says when it ended
            future.add_done_callback(lambda f, t0=t0: setattr(f, 'took', time.time() - t0))
        failed = {name: f.exception() for name, f in futures.items() if f.exception()}
        print(f"{len(SCENARIOS)} scenarios in {time.time() - t0:.0f} s: " + ', '.join(
            f"{name} {f.took:.0f} s" for name, f in futures.items()))
        for name, error in failed.items():
            print(f"{name}: {str(error).splitlines()[0]}")
    assert not failed, ', '.join(failed)


def test_a_slurm_sweep_s_jobs_preempted_by_a_higher_priority_job_resume_after_it(cluster,
                                                                                 workdir):
    """A job of every CPU on partition high: both jobs on debug get SIGTERM (PreemptMode=REQUEUE),
    save, go back to the queue and resume once it ends."""
    def preempt(job, _):
        subprocess.run(['sbatch', '-p', 'high', '-c', str(CPUS), '-o', '/dev/null', '--wrap',
                        'sleep 5'], check=True, capture_output=True)
    with cluster_for_this_test(cluster):
        # GraceTime=0 (SLURM's default): SIGTERM within a second (with a GraceTime SLURM waited
        # for its next periodic check: 25 s here, for GraceTime 2 or 15)
        ends_finished(workdir, 'preempted', 100, mid_run(workdir, 'preempted', preempt,
                                                         'seqtopk-k2-s1'), (1,), seqtopk_stops=(1,))
