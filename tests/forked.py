"""
The scripts run as python runs them (offline, one thread), each in a process forked from
multiprocessing's forkserver, which imported torch once: not a fresh python's 3 CPU seconds of
imports each. A command line that is not a script (-m ...), or an environment that changes what
python and torch read as they start, execs a fresh python there. The forkserver ends once pytest
and the last of its forks have.
"""
import atexit
import contextlib
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import tempfile
import traceback

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
# one thread, in pytest and every script: tiny runs gain nothing from more, and two threads waiting
# for each other on a busy machine made a 1 s test take ten minutes; CUDA asked through NVML: the
# forkserver leaves its forks free to start CUDA
OFFLINE_ENV = dict(os.environ, HF_DATASETS_OFFLINE='1', HF_HUB_OFFLINE='1', PYTHONUNBUFFERED='1',
                   OMP_NUM_THREADS='1', PYTORCH_NVML_BASED_CUDA_CHECK='1')
os.environ.update(OFFLINE_ENV)
torch.set_num_threads(1)
HANG = 900  # seconds: the limit on a script's run or a wait, which only a hang reaches
FORKS = multiprocessing.get_context('forkserver')
FORKS.set_forkserver_preload(['forked', 'torch._dynamo'])  # torch.optim's first step imports it
AT_START = ('PYTHON', 'LD_', 'OMP_', 'MKL_', 'KMP_', 'TORCH_', 'PYTORCH_')


def python_in_fork(argv, cwd, env, out, err, before):
    """In a fork of the forkserver: `python argv` in cwd with env, stdout and stderr to files."""
    for fd, name in enumerate((os.devnull, out, err)):
        os.dup2(os.open(name, os.O_RDWR | os.O_APPEND), fd)
    assert len(os.listdir(f'/proc/{os.getppid()}/task')) == 1, 'forked with a thread running'
    os.chdir(cwd)
    if argv[0].startswith('-') or any(
            env.get(k) != os.environ.get(k) for k in {*env, *os.environ} if k.startswith(AT_START)):
        os.execve(sys.executable, [sys.executable, *argv], env)
    os.environ.clear()
    os.environ.update(env)
    sys.stdout, sys.stderr = (open(fd, 'w', buffering=1, closefd=False) for fd in (1, 2))
    ours = {'', REPO, os.path.join(REPO, 'tests'), os.path.join(REPO, 'experiments')}  # pytest's
    sys.argv = list(argv)
    sys.path[:] = [os.path.dirname(argv[0])] + [p for p in sys.path if p not in ours]
    try:
        if before:
            before()
        runpy.run_path(argv[0], run_name='__main__')
    except Exception:  # as python ends on one
        traceback.print_exc()
        sys.exit(1)
    finally:
        atexit._run_exitfuncs()  # python's exit runs them (W&B's), a multiprocessing fork's not


def python(*argv, cwd, env=OFFLINE_ENV, before=None):
    """`python argv` in cwd, as subprocess.run(..., capture_output=True, text=True) gives it, in a
    fork of the forkserver; before: a function (of a module) it calls before the script."""
    with contextlib.chdir(os.path.dirname(__file__)):  # python 3.11's forkserver imports its
        multiprocessing.forkserver.ensure_running()  # preloads from its cwd, not from sys.path
    with tempfile.NamedTemporaryFile('r') as out, tempfile.NamedTemporaryFile('r') as err:
        forked = FORKS.Process(target=python_in_fork,
                               args=(argv, str(cwd), env, out.name, err.name, before))
        forked.start()
        forked.join(HANG)
        if forked.exitcode is None:  # a hang: ended as subprocess.run's timeout ends it
            forked.kill()
            raise subprocess.TimeoutExpired(argv, HANG)
        return subprocess.CompletedProcess([sys.executable, *argv], forked.exitcode, out.read(),
                                           err.read())


def run(script, *args, cwd, env=OFFLINE_ENV, before=None):
    """`python script args`: script a path from the repository's root."""
    return python(os.path.join(REPO, script), *args, cwd=cwd, env=env, before=before)


class ForkedRun(FORKS.Process):
    """subprocess.Popen's part that sweep.py uses, for a train.py run: a fork of the forkserver in
    a session of its own, stdout and stderr to the log Popen was given."""

    def __init__(self, cmd, stdout, stderr, start_new_session, **_):
        assert stderr == subprocess.STDOUT and start_new_session, cmd  # what sweep.py passes
        super().__init__(target=python_in_fork, args=(cmd[1:], os.getcwd(), dict(os.environ),
                                                      stdout.name, stdout.name, os.setsid))
        self.start()
        # its exit status read by wait() alone: Process.start() in another of the sweep's threads
        # reads every child's from the forkserver's pipe first, and then join() here says 255
        multiprocessing.process._children.discard(self)

    def wait(self):
        self.join()
        return self.exitcode

    def send_signal(self, sig):
        os.kill(self.pid, sig)


def forked_runs():
    """In sweep.py's process (a fork): its train.py runs forked by pytest's forkserver, whose
    address and pipe it holds (not by one of its own: 3 CPU-s); git and the like started."""
    multiprocessing.forkserver._forkserver.ensure_running = lambda: None  # it runs: pytest's
    popen, train = subprocess.Popen, os.path.join(REPO, 'train.py')
    subprocess.Popen = lambda cmd, *args, **kwargs: (
        ForkedRun if cmd[1:2] == [train] else popen)(cmd, *args, **kwargs)


def sweep(*args, cwd):
    """experiments/sweep.py as run() gives it, its train.py runs forked: for the sweeps whose
    claims are their runs' results (those about processes start sweep.py as a user does)."""
    return run('experiments/sweep.py', *args, cwd=cwd, before=forked_runs)
