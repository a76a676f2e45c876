"""
What the tests share: a tiny model and a learnable toy language to train it on, the scripts run as
subprocesses (offline, one thread), and the built-in data prepared and a tiny run trained once per
test session, shared by pytest-xdist's workers.
Run: python -m pytest -q -n auto
"""
import atexit
import json
import os
import runpy
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
from filelock import FileLock

from model import GPT, GPTConfig
from router import step_ks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
TINY = os.path.join(REPO, 'config', 'tiny.py')
# one thread: these tiny runs do not gain from more, and stay fast on a busy machine
OFFLINE_ENV = dict(os.environ, HF_DATASETS_OFFLINE='1', HF_HUB_OFFLINE='1', PYTHONUNBUFFERED='1',
                   OMP_NUM_THREADS='1')
# and in the tests' own process (-n auto: a process per core): on a busy machine, two threads that
# wait for each other at every op made a test of a second take ten minutes
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
# a tiny model and what it learns

def random_scores(B, T, N, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randint(0, 3, (B, T, N), generator=g).float() if ties
              else torch.randn(B, T, N, generator=g))
    return logits.softmax(-1)


def tiny_config(router, **kw):
    """config/tiny.py's model on a 16-token vocabulary (the counting language's)."""
    shape = {k: v for k, v in runpy.run_path(TINY).items() if k in GPTConfig.__dataclass_fields__}
    return GPTConfig(router=router, **{**shape, 'vocab_size': 16, **kw})


def counting_batches(seed=0, B=8, T=32):
    """A learnable language: counting upward mod 16 from a random start."""
    g = torch.Generator().manual_seed(seed)
    while True:
        seq = (torch.randint(0, 16, (B, 1), generator=g) + torch.arange(T + 1)) % 16
        yield seq[:, :-1], seq[:, 1:]


def train_tiny(model, steps, lr=3e-3, check=None):
    opt = model.configure_optimizers(0.0, lr, (0.9, 0.99), 'cpu')
    losses = []
    for _, (x, y) in zip(range(steps), counting_batches()):
        _, ce, aux = model(x, y, moe_ks=step_ks(model.config, len(model.routers())))
        (ce + aux['aux_loss']).backward()
        opt.step()
        opt.zero_grad()
        # the routers' step rule, once per step (relu's lambda; a no-op for most)
        model.after_step()
        losses.append(ce.item())
        if check:
            check(aux['routing'])
    return losses


def trained_tiny(router, **kw):
    torch.manual_seed(0)
    model = GPT(tiny_config(router, **kw))
    train_tiny(model, 10)
    return model.eval()


def train_step(model, x, y, moe_ks=None):
    """Loss and gradients of one training step (forward + backward)."""
    model.zero_grad()
    _, ce, aux = model(x, y, moe_ks=moe_ks)
    (ce + aux['aux_loss']).backward()
    return ce.detach(), [p.grad.clone() for p in model.parameters()]


# -----------------------------------------------------------------------------
# the scripts

# A process that has imported torch once and forks a process for each script run: `python args`
# as python would run it, in a process of its own, with its argv, sys.path[0], cwd, environment,
# stdin, stdout, stderr and exit status (a SystemExit's, a traceback's), but without its 3-5 CPU
# seconds of `import torch` (torch.optim's first use imports torch._dynamo too). A run whose
# environment changes what python and torch read as they start (PYTHONPATH, OMP_NUM_THREADS, ...)
# starts afresh. It listens on a Unix socket: a request is the run's argv, cwd and environment, with
# its stdin, stdout and stderr; the answers, the run's pid and its exit status. Requests may
# overlap (a bash script's parts): each is handled in a process of its own.
ZYGOTE = r"""
import gc, json, os, runpy, signal, socket, sys
gc.disable()  # gc.freeze's recipe for forks: the imports' objects packed, then frozen
import numpy, torch, torch._dynamo  # no thread started yet: safe to fork
gc.freeze()  # never scanned by a run's collections, so their pages stay shared (exit: 1.5 -> 0.6 s)
AT_START = ('PYTHON', 'LD_', 'OMP_', 'MKL_', 'KMP_', 'TORCH_', 'PYTORCH_')
started = {k: v for k, v in os.environ.items() if k.startswith(AT_START)}
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the handlers, reaped as they end
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
server.listen(64)
print('listening', flush=True)
while True:
    conn = server.accept()[0]
    if os.fork():
        conn.close()
        continue
    server.close()  # a request's handler: the run forked, waited for, its pid and status said
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    request, fds = b'', []
    while not request.endswith(b'\n'):
        data, received, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        request, fds = request + data, fds + received
    argv, cwd, env = json.loads(request)
    pid = os.fork()
    if pid == 0:  # the run: its own files, folder, environment and arguments
        gc.enable()
        conn.close()
        for fd, received in enumerate(fds):
            os.dup2(received, fd)
            os.close(received)
        os.chdir(cwd)
        if ({k: v for k, v in env.items() if k.startswith(AT_START)} != started
                or argv[0].startswith('-') and argv[0] not in ('-c', '-m')):  # -u, -X, ...
            os.execve(sys.executable, [sys.executable, *argv], env)
        os.environ.clear()
        os.environ.update(env)
        if argv[0] == '-c':  # an exception exits as python's does
            sys.argv, sys.path[0] = ['-c', *argv[2:]], ''
            exec(argv[1], {'__name__': '__main__', '__builtins__': __builtins__})
        elif argv[0] == '-m':
            sys.argv, sys.path[0] = argv[1:], cwd
            runpy.run_module(argv[1], run_name='__main__', alter_sys=True)
        else:
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name='__main__')
        sys.exit(0)
    conn.sendall(b'%d\n' % pid)
    conn.sendall(b'%d\n' % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    os._exit(0)
"""
zygote = None  # this process's (each pytest-xdist worker has its own), and its socket's path


def zygote_socket():
    """The path of this process's zygote's socket, the zygote started at the first call."""
    global zygote
    if zygote is None or zygote[0].poll() is not None:
        folder = tempfile.mkdtemp()
        path = os.path.join(folder, 'zygote')
        started = subprocess.Popen([sys.executable, '-c', ZYGOTE, path], env=OFFLINE_ENV,
                                   text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        assert started.stdout.readline() == 'listening\n', 'the zygote did not start'
        atexit.register(shutil.rmtree, folder, True)
        atexit.register(started.wait)
        atexit.register(started.kill)  # first: atexit runs these in reverse
        zygote = started, path
    return zygote[1]


# A `python` for a script that is not Python (gpu.sh): each run forked from the zygote as run()'s
# are, the signals it gets passed on, the run's exit status its own (a SIGKILL ends only it: for
# runs that no limit stops)
PYTHON = r"""
import json, os, signal, socket, sys
with socket.socket(socket.AF_UNIX) as conn:
    conn.connect(SOCKET)
    socket.send_fds(conn, [json.dumps([sys.argv[1:], os.getcwd(), dict(os.environ)]).encode()
                           + b'\n'], [0, 1, 2])
    said = conn.makefile()
    pid = int(said.readline())
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda sig, frame: os.kill(pid, sig))
    code = int(said.readline())
if code < 0:  # killed by a signal: so is this
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def forking_python(folder):
    """folder, made, with a `python` in it (PYTHON), to put first on a script's PATH."""
    os.makedirs(folder)
    code, shim = (os.path.join(folder, name) for name in ('forking_python.py', 'python'))
    with open(code, 'w') as f:
        f.write(PYTHON.replace('SOCKET', repr(zygote_socket())))
    with open(shim, 'w') as f:  # -S: the standard library only, started in milliseconds
        f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S {shlex.quote(code)} "$@"\n')
    os.chmod(shim, 0o755)
    return folder


def forked(argv, cwd, env, stdin, stdout, stderr, timeout=HANG):
    """`python argv` forked from the zygote (ZYGOTE), files given as open files: its exit status;
    after timeout seconds of a hang, killed, as subprocess.run's timeout ends it."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(zygote_socket())
        socket.send_fds(conn, [json.dumps([argv, str(cwd), env]).encode() + b'\n'],
                        [f.fileno() for f in (stdin, stdout, stderr)])
        conn.settimeout(timeout)
        said = conn.makefile()
        pid = int(said.readline())
        try:
            return int(said.readline())
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(argv, timeout)


def run(script, *args, cwd, env=OFFLINE_ENV, driver=None):
    """`python script args` (or `python -c driver script args`) in cwd, as subprocess.run(...,
    capture_output=True) gives it, forked from the zygote."""
    argv = [*(('-c', driver) if driver else ()), os.path.join(REPO, script), *args]
    with tempfile.TemporaryFile('w+') as out, tempfile.TemporaryFile('w+') as err, \
            open(os.devnull) as nothing:
        code = forked(argv, cwd, env, nothing, out, err)
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess([sys.executable, *argv], code, out.read(), err.read())


# a driver's last lines (it imports os, runpy and sys): the script, as `python script args` runs it
THE_SCRIPT = """
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))  # as `python script` would
runpy.run_path(script, run_name='__main__')
"""


# `python -c FORKED_RUNS experiments/sweep.py args`: the sweep, whose runs are forked from its own
# process (the zygote's, torch imported) instead of a fresh `python train.py` each. A run is still a
# process of its own as Popen's would be: its session, PDEATHSIG, log, argv, signal dispositions,
# exit status (a SystemExit's, a traceback's), fds 0-2 only; it only skips 4 CPU seconds of
# imports. For the sweeps whose claims are their runs' results; those about processes start them.
FORKED_RUNS = r"""
import os, runpy, signal, subprocess, sys, traceback
Popen = subprocess.Popen

class Forked:
    def __init__(self, cmd, stdout, stderr, start_new_session, preexec_fn):
        assert stderr == subprocess.STDOUT and start_new_session, cmd
        self.pid = os.fork()
        if self.pid:
            return
        code = 1
        try:
            os.setsid()
            preexec_fn()
            for fd in (1, 2):
                os.dup2(stdout.fileno(), fd)
            os.closerange(3, os.sysconf('SC_OPEN_MAX'))
            sys.stdout, sys.stderr = (open(fd, 'w', 1, closefd=False) for fd in (1, 2))
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # as exec leaves them
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                              else signal.SIG_DFL)
            subprocess.Popen = Popen
            sys.argv, sys.path[0] = cmd[1:], os.path.dirname(TRAIN)
            runpy.run_path(TRAIN, run_name='__main__')
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)

    def wait(self):
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])

    def send_signal(self, sig):
        os.kill(self.pid, sig)

def launch(cmd, *args, **kwargs):  # train.py forked; git and the like started as before
    return (Forked if cmd[:2] == [sys.executable, TRAIN] else Popen)(cmd, *args, **kwargs)

subprocess.Popen = launch
""".replace('TRAIN', repr(os.path.join(REPO, 'train.py'))) + THE_SCRIPT


def sweep(*args, cwd):
    """experiments/sweep.py with its runs forked (FORKED_RUNS), as run() gives it."""
    return run('experiments/sweep.py', *args, cwd=cwd, driver=FORKED_RUNS)


# `python -c TWO_RANKS train.py args`: a DDP job of two ranks as `torchrun --standalone
# --nproc_per_node=2 train.py args` starts it (their environment: the env:// rendezvous on a free
# port; one stdout; a rank that fails ends the job), each rank forked (torch imported) instead of
# three fresh Pythons' 12 CPU seconds of imports. For the claims about DDP's results; those about
# torchrun itself run torchrun.
TWO_RANKS = r"""
import os, runpy, signal, socket, sys
with socket.socket() as free:
    free.bind(('127.0.0.1', 0))
    port = free.getsockname()[1]
pids = []
for rank in range(2):
    pids.append(os.fork())
    if not pids[-1]:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE='2',
                          LOCAL_WORLD_SIZE='2', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
SCRIPT
        sys.exit(0)
codes = {}
while len(codes) < len(pids):
    pid, status = os.wait()
    codes[pid] = os.waitstatus_to_exitcode(status)
    for other in set(pids) - set(codes) if codes[pid] else ():  # as torchrun: the job ends
        os.kill(other, signal.SIGKILL)
sys.exit(next((code for code in codes.values() if code), 0))
""".replace('SCRIPT', textwrap.indent(THE_SCRIPT.strip(), ' ' * 8))


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
