"""
What the tests share: the scripts run as python runs them (offline, one thread) in processes forked
from multiprocessing's forkserver, the built-in data prepared and a tiny run trained once per test
session, shared by pytest-xdist's workers; and tiny.py's model and toy language.
Run: python -m pytest -q -n auto
"""
import atexit
import contextlib
import ctypes
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback

import pytest
import torch
from filelock import FileLock

from tiny import (TINY, counting_batches, random_scores, tiny_config, train_step,  # noqa: F401
                  train_tiny, trained_tiny)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
# one thread: these tiny runs do not gain from more, and stay fast on a busy machine; CUDA asked
# for through NVML, so that the forkserver's needs_cuda leaves its forks free to start CUDA
OFFLINE_ENV = dict(os.environ, HF_DATASETS_OFFLINE='1', HF_HUB_OFFLINE='1', PYTHONUNBUFFERED='1',
                   OMP_NUM_THREADS='1', PYTORCH_NVML_BASED_CUDA_CHECK='1')
# and in the tests' own process (-n auto: a process per core), so the forkserver's: on a busy
# machine, two threads that wait for each other at every op made a test of a second take ten
# minutes
os.environ.update(OFFLINE_ENV)
torch.set_num_threads(1)
# seconds: the limit on a script's run or a wait, which only a hang reaches (the longest, a sweep of
# 16 tiny runs, takes about a minute, and five on a machine loaded ten times over)
HANG = 900
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pytest_collection_modifyitems(items):
    """The tests marked long first, the last collected (the walkthrough, gpu.sh: the longest)
    first of all: with -n auto a worker starts each while the others work through the short
    ones, instead of running it alone at the end."""
    long = [item for item in items if item.get_closest_marker('long')]
    items[:] = long[::-1] + [item for item in items if not item.get_closest_marker('long')]


# -----------------------------------------------------------------------------
# the scripts

# A script runs in a process forked from multiprocessing's forkserver, which imported torch once
# (this module): not a fresh python's 3 CPU seconds of imports each. A command line that is not a
# script (-m torch.distributed.run ...), or an environment that changes what python and torch read
# as they start, execs a fresh python there.
FORKS = multiprocessing.get_context('forkserver')
FORKS.set_forkserver_preload(['conftest', 'torch._dynamo'])  # torch.optim's first step imports it
AT_START = ('PYTHON', 'LD_', 'OMP_', 'MKL_', 'KMP_', 'TORCH_', 'PYTORCH_')
PRCTL = ctypes.CDLL(None).prctl


def python_in_fork(argv, cwd, env, out, err, before):
    """In a process the forkserver forked: `python argv` in cwd with env, its stdout and stderr to
    the files out and err; ended when pytest ends (a fresh python by SIGTERM, which torchrun
    passes on to its ranks)."""
    fresh = argv[0].startswith('-') or any(
        env.get(k) != os.environ.get(k) for k in {*env, *os.environ} if k.startswith(AT_START))
    PRCTL(1, signal.SIGTERM if fresh else signal.SIGKILL)  # PR_SET_PDEATHSIG: at the
    server = multiprocessing.forkserver._forkserver  # forkserver's end, which follows pytest's
    os.close(server._forkserver_alive_fd)  # once no fork holds the pipe it watches
    server._forkserver_alive_fd = None
    for fd, name in enumerate((os.devnull, out, err)):
        os.dup2(os.open(name, os.O_RDWR | os.O_APPEND), fd)
    assert len(os.listdir(f'/proc/{os.getppid()}/task')) == 1, 'forked with a thread running'
    os.chdir(cwd)
    if fresh:
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
        atexit._run_exitfuncs()  # python's exit runs them, a multiprocessing child's does not


def python(*argv, cwd, env=OFFLINE_ENV, before=None):
    """`python argv` in cwd, as subprocess.run(..., capture_output=True, text=True) gives it, in a
    process the forkserver forked; before: a function (of a module) it calls before the script."""
    with contextlib.chdir(os.path.dirname(__file__)):  # python 3.11's forkserver imports its
        multiprocessing.forkserver.ensure_running()  # preloads from its cwd, not from our sys.path
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


class ForkedRun:
    """subprocess.Popen's part that sweep.py uses, for a train.py run: a process the forkserver
    forked, in a session of its own, its stdout and stderr the log Popen was given."""

    def __init__(self, cmd, stdout, stderr, start_new_session, preexec_fn):
        assert stderr == subprocess.STDOUT and start_new_session, cmd
        self.run = FORKS.Process(target=python_in_fork, args=(
            cmd[1:], os.getcwd(), dict(os.environ), stdout.name, stdout.name, os.setsid))
        self.run.start()
        self.pid = self.run.pid

    def wait(self):
        self.run.join()
        return self.run.exitcode

    def send_signal(self, sig):
        os.kill(self.pid, sig)


def forked_runs():
    """In sweep.py's process (a fork of pytest's forkserver): its train.py runs forked (ForkedRun)
    by that forkserver too, not by one it would start (3 CPU seconds); git and the like started."""
    server = multiprocessing.forkserver._forkserver  # its address known; its pipe's end, given
    server.ensure_running, server._forkserver_alive_fd = (lambda: None), os.open(os.devnull, 0)
    popen, train = subprocess.Popen, os.path.join(REPO, 'train.py')
    subprocess.Popen = lambda cmd, *args, **kwargs: (
        ForkedRun if cmd[1:2] == [train] else popen)(cmd, *args, **kwargs)


def sweep(*args, cwd):
    """experiments/sweep.py as run() gives it, its train.py runs forked instead of a fresh python's
    3 CPU seconds each: for the sweeps whose claims are their runs' results; those about processes
    start sweep.py and its runs as a user does."""
    return run('experiments/sweep.py', *args, cwd=cwd, before=forked_runs)


def one_error_line(result):
    """The run failed with exactly one line on stderr, an `error:` line, and no traceback."""
    assert result.returncode != 0 and 'Traceback' not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), result.stderr
    return lines[0]


def exit_message(script, args, monkeypatch):
    """Run a script in this process, as `python script args` would, up to its SystemExit."""
    monkeypatch.setattr(sys, 'argv', [script, *args])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(os.path.join(REPO, script), run_name='__main__')
    return str(stopped.value.code)


def made_once(tmp_path_factory, name, make):
    """A folder made by make(path) once for the whole session: the first pytest-xdist worker to
    ask makes it, the others wait for it and share it (they only read it)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get('PYTEST_XDIST_WORKER'):
        root = root.parent  # the session's folder, above each worker's own
    path = root / name
    with FileLock(str(root / f'{name}.lock')):
        if not (root / f'{name}.made').exists():
            shutil.rmtree(path, ignore_errors=True)  # what a worker that failed left
            path.mkdir()
            make(path)
            (root / f'{name}.made').touch()
    return path


@pytest.fixture(scope='session')
def prepared(tmp_path_factory):
    """A folder whose data/ holds the built-in dataset (characters), prepared once for the whole
    session."""
    def prepare(path):
        result = run('prepare.py', cwd=path)
        assert result.returncode == 0, result.stderr
    return made_once(tmp_path_factory, 'prepared', prepare)


@pytest.fixture(scope='session')
def trained(prepared, tmp_path_factory):
    """A folder with the built-in data and one finished 10-step run in run/ (ckpt.pt at step 10),
    trained once for the whole session."""
    def train(path):
        shutil.copytree(prepared / 'data', path / 'data')
        result = run('train.py', TINY, '--max_iters=10', '--out_dir=run', cwd=path)
        assert result.returncode == 0, result.stderr
    return made_once(tmp_path_factory, 'trained', train)


@pytest.fixture(scope='module')
def workdir(trained, tmp_path_factory):
    """A folder of the module's own with the built-in data and a copy of the session's finished
    10-step run in run/ (ckpt.pt at step 10)."""
    path = tmp_path_factory.mktemp('work')
    for folder in ('data', 'run'):
        shutil.copytree(trained / folder, path / folder)
    return path
