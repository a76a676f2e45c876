"""
The scripts' answers to faults, as tests: any bad checkpoint file, a diverging run, SIGTERM and
torchrun stopping every rank at the same step, a run killed while saving, damaged data folders, a
full disk, an out_dir that cannot be one. Each ends with one line, and the last good checkpoint
kept.
Run: python -m pytest -q
"""
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from functools import partial

import pytest
import torch

from conftest import HANG, OFFLINE_ENV, REPO, TINY, exit_message, one_error_line, run

# -----------------------------------------------------------------------------
# checkpoint files

def bad_checkpoints(good_path, folder):
    """name -> (path of a bad ckpt.pt, what its error must say)."""
    good = torch.load(good_path, weights_only=True)
    data = open(good_path, 'rb').read()
    nanogpt = dict(model={'transformer.wte.weight': torch.zeros(65, 8)}, optimizer={}, iter_num=5,
                   best_val_loss=1.0,
                   model_args=dict(n_layer=1, n_head=1, n_embd=8, block_size=8, bias=False,
                                   vocab_size=65, dropout=0.0),
                   config={'dataset': 'shakespeare_char'})
    nan_weights = dict(good, model={k: v.clone().fill_(float('nan')) if i == 0 else v
                                    for i, (k, v) in enumerate(good['model'].items())})
    kinds = {'garbage': (os.urandom(4096), 'is not a torch checkpoint file'),
             'text': (b'{"model": 1}\n', 'is not a torch checkpoint file'),
             'empty': (b'', 'is empty'),
             'truncated': (data[:len(data) // 2], 'is truncated or corrupt'),
             'nanogpt': (nanogpt, 'from another project (nanoGPT?)'),
             'no_model_args': ({k: v for k, v in good.items() if k != 'model_args'},
                               'it has no model_args'),
             'missing_weight': (dict(good, model=dict(list(good['model'].items())[1:])),
                                'missing transformer.wte.weight'),
             'nan_weights': (nan_weights, 'holds non-finite weights'),
             'newer': (dict(good, model_args=dict(good['model_args'], expert_shards=2)),
                       'has model settings this version does not know: expert_shards'),
             'text_k': (dict(good, model_args=dict(good['model_args'], top_k='2')),
                        "has a model setting of the wrong type: top_k='2', not int"),
             'float_layers': (dict(good, model_args=dict(good['model_args'], n_layer=2.0)),
                              'has a model setting of the wrong type: n_layer=2.0, not int'),
             'no_tokenizer': (dict(good, meta={'vocab_size': 76}), 'has no tokenizer in its meta'),
             'tensor': (torch.ones(3), 'holds a Tensor, not a checkpoint')}
    paths = {}
    for name, (content, message) in kinds.items():
        os.makedirs(folder / name)
        path = folder / name / 'ckpt.pt'
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            torch.save(content, path)
        paths[name] = (path, message)
    return paths


def test_any_bad_checkpoint_file_gets_one_line_from_train_and_sample(
        workdir, tmp_path, monkeypatch):
    monkeypatch.chdir(workdir)
    for name, (path, message) in bad_checkpoints(workdir / 'run' / 'ckpt.pt', tmp_path).items():
        for script, args in (('train.py',
                              [TINY, f'--init_from={path}', f'--out_dir={tmp_path}/ft']),
                             ('sample.py', [f'--out_dir={path.parent}'])):
            line = exit_message(script, args, monkeypatch)
            assert (line.startswith(f'error: {path} ') and message in line
                    and '\n' not in line), (name, script, line)
        if name == 'garbage':  # and the real thing, as a user runs it
            assert str(path) in one_error_line(run('sample.py', f'--out_dir={path.parent}',
                                                   cwd=workdir))
            assert str(path) in one_error_line(run('train.py', f'--init_from={path}',
                                                   '--out_dir=ft', cwd=workdir))
    # resuming needs the optimizer and RNG state as well
    out = tmp_path / 'no_optimizer'
    out.mkdir()
    torch.save({k: v for k, v in torch.load(workdir / 'run' / 'ckpt.pt', weights_only=True).items()
                if k != 'optimizer'}, out / 'ckpt.pt')
    line = exit_message('train.py', [TINY, '--init_from=resume', f'--out_dir={out}'], monkeypatch)
    assert 'it has no optimizer' in line
    # and a state that does not fit this run's optimizer: one line, and how to fine-tune instead
    out = tmp_path / 'other_optimizer'
    out.mkdir()
    other = torch.load(workdir / 'run' / 'ckpt.pt', weights_only=True)
    other['optimizer']['param_groups'] = other['optimizer']['param_groups'][:1]  # of 2
    torch.save(other, out / 'ckpt.pt')
    line = exit_message('train.py', [TINY, '--init_from=resume', f'--out_dir={out}'], monkeypatch)
    assert line == (f"error: {out}/ckpt.pt has an optimizer or RNG state this run cannot restore "
                    f"(ValueError); fine-tune from it instead: --init_from={out}/ckpt.pt "
                    f"--out_dir=ANOTHER_DIR")


# -----------------------------------------------------------------------------
# faults: divergence, preemption

def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(workdir, tmp_path):
    out = tmp_path / 'div'
    shutil.copytree(workdir / 'run', out)
    before = (out / 'ckpt.pt').read_bytes()
    line = one_error_line(run('train.py', TINY, '--init_from=resume', '--max_iters=40',
                              '--learning_rate=1e4', f'--out_dir={out}', cwd=workdir))
    assert (re.search(r'at step \d+: the run diverged', line)
            and 'lower --learning_rate' in line), line
    # the command it prints goes on at a tenth of the learning rate, not at the one that diverged
    assert line.endswith(" --max_iters=40 --out_dir=" + str(out) + " --learning_rate=1000 "
                         "--init_from=resume"), line
    assert (out / 'ckpt.pt').read_bytes() == before  # not replaced
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 10 and all(torch.isfinite(v).all() for v in ckpt['model'].values())
    assert json.loads(open(out / 'log.jsonl').readlines()[-1])['event'] == 'diverged'
    resumed = run('train.py', TINY, '--init_from=resume', '--max_iters=12', f'--out_dir={out}',
                  cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    # a run that diverges before its first save says so, and how to start again
    line = one_error_line(run('train.py', TINY, '--learning_rate=1e4', f'--out_dir={out}-new',
                              cwd=workdir))
    assert line.endswith("; this run wrote no checkpoint; lower --learning_rate (now 10000), then "
                         "start again with --overwrite=True"), line
    assert not (tmp_path / 'div-new' / 'ckpt.pt').exists()


def train_losses(out_dir):
    return {r['iter']: r['ce'] for r in map(json.loads, open(out_dir / 'log.jsonl'))
            if r['event'] == 'train'}


def start_and_stop(cmd, cwd, after_line, target=None, group=False, sig=signal.SIGTERM):
    """Start a training command, send sig (to target(pid), the process, or with group=True its
    whole process group, as a terminal's Ctrl-C) once after_line is printed, and return (return
    code, output, the step it stopped after)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=OFFLINE_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=group)
    output = []
    for line in proc.stdout:
        output.append(line)
        if line.startswith(after_line):
            if group:
                os.killpg(proc.pid, sig)
            else:
                os.kill(target(proc.pid) if target else proc.pid, sig)
            break
    output += proc.stdout.readlines()
    output = ''.join(output)
    stopped = re.search(r'stopped after step (\d+) and saved', output)
    return proc.wait(timeout=HANG), output, int(stopped.group(1)) if stopped else None


def test_sigterm_saves_and_resume_equals_an_uninterrupted_run(workdir):
    common = [os.path.join(REPO, 'train.py'), TINY, '--lr_decay_iters=40', '--eval_interval=1000',
              '--log_interval=1']
    rc, output, step = start_and_stop(
        [sys.executable, *common, '--max_iters=100000', '--out_dir=sig'],
        workdir, after_line='iter 3:')
    assert rc == 0 and step is not None and 'Traceback' not in output, output
    assert f"continue with: python {common[0]}" in output and '--init_from=resume' in output
    assert torch.load(workdir / 'sig' / 'ckpt.pt', weights_only=True)['iter_num'] == step
    end = step + 5
    resumed = run(*common, f'--max_iters={end}', '--init_from=resume', '--out_dir=sig', cwd=workdir)
    straight = run(*common, f'--max_iters={end}', '--out_dir=sig-straight', cwd=workdir)
    assert resumed.returncode == 0 and straight.returncode == 0, resumed.stderr + straight.stderr
    a, b = train_losses(workdir / 'sig-straight'), train_losses(workdir / 'sig')
    assert sorted(a) == sorted(b) == list(range(1, end + 1))
    assert all(a[i] == pytest.approx(b[i], abs=1e-6) for i in a)
    # the final eval line
    assert resumed.stdout.splitlines()[-2] == straight.stdout.splitlines()[-2]


def catches(pid, sig):
    """Whether process pid has a handler installed for sig (Linux /proc: the SigCgt mask)."""
    mask = next(line for line in open(f'/proc/{pid}/status') if line.startswith('SigCgt:'))
    return bool(int(mask.split()[1], 16) >> (sig - 1) & 1)


@pytest.mark.skipif(not os.path.exists('/proc/self/status'),
                    reason="sees that run.listen() ran through /proc")
def test_a_signal_stops_an_evaluation_at_once_and_a_second_stops_training_at_once(workdir,
                                                                                  tmp_path):
    def started(*args):  # in the first evaluation's million batches
        proc = subprocess.Popen([sys.executable, os.path.join(REPO, 'train.py'), TINY,
                                 '--eval_iters=1000000', *args], cwd=workdir, env=OFFLINE_ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        while 'parameters' not in proc.stdout.readline():
            pass
        deadline = time.time() + HANG  # past run.listen() in well under a second
        while not catches(proc.pid, signal.SIGTERM) and time.time() < deadline:
            time.sleep(0.05)  # not a fixed wait: a busy machine is only later to get there
        return proc
    procs = []
    try:
        evaluation = started('--eval_only=True', f"--init_from={workdir / 'run' / 'ckpt.pt'}",
                             f'--out_dir={tmp_path}/eval')
        evaluation.send_signal(signal.SIGTERM)  # nothing to save: no waiting
        out = evaluation.communicate(timeout=HANG)[0]
        assert evaluation.returncode == 1 and out.splitlines()[-1] == (
            "error: SIGTERM: stopped the evaluation before its end"), out
        training = started(f'--out_dir={tmp_path}/train')
        training.send_signal(signal.SIGINT)  # Ctrl-C: after the step, which the evaluation holds up
        assert training.stdout.readline() == "SIGINT: stopping after this step (again: at once)\n"
        training.send_signal(signal.SIGINT)  # at once: the same Ctrl-C, passed on by torchrun
        time.sleep(2.5)
        assert training.poll() is None
        training.send_signal(signal.SIGINT)  # again: now
        out = training.communicate(timeout=HANG)[0]
        assert training.returncode == 1 and out.splitlines()[-1] == (
            "error: SIGINT again: stopped at once; this run wrote no checkpoint; start again with "
            "--overwrite=True"), out
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_rank_failing_before_the_ranks_join_leaves_rank_0_time_to_say_why(tmp_path,
                                                                             monkeypatch):
    # torchrun stops every rank once one exits: a rank other than 0 that failed a check every
    # rank makes (seen on an H100: more processes than GPUs) exited silently first, and rank 0
    # was stopped before its line; one still running after the wait failed alone, and says so
    from checkpoint import Run
    waits = []
    monkeypatch.setattr(time, 'sleep', waits.append)
    for master, wait in ((True, []), (False, [5])):
        with pytest.raises(SystemExit) as stop:
            Run(str(tmp_path), ddp=True, master=master, world_size=2, settings={}).fail('bad')
        assert stop.value.code == 'error: bad' and waits == wait


def test_a_signal_that_comes_again_while_the_first_is_announced_is_announced_once(tmp_path,
                                                                                   capsys):
    # timeout(1) sends SIGTERM to the run and again to its process group: the second can land
    # inside the first's print (seen on a GPU machine as the message twice on one line)
    from checkpoint import Run
    stop = Run(str(tmp_path), ddp=False, master=True, world_size=1, settings={})
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    class Interrupted:  # stdout whose first write brings the second signal
        def __init__(self):
            self.text, self.sent = '', False

        def write(self, text):
            if not self.sent:
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)
            self.text += text

        def flush(self):
            pass
    out = Interrupted()
    try:
        stop.listen()
        with capsys.disabled():
            sys.stdout, real = out, sys.stdout
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
            finally:
                sys.stdout = real
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert out.sent and stop.signal == 'SIGTERM'
    assert out.text == "SIGTERM: stopping after this step (again: at once)\n"


@pytest.mark.skipif(not hasattr(os, 'killpg'), reason="sends a signal to a process group")
def test_a_ctrl_c_to_a_torchrun_job_saves_though_torchrun_passes_it_on_again(workdir):
    # a terminal's Ctrl-C reaches every process of the job, and torchrun sends it on to its workers
    _, output, step = start_and_stop(
        [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
         os.path.join(REPO, 'train.py'), TINY, '--device=cpu', '--max_iters=100000',
         '--eval_interval=1000', '--log_interval=1', '--out_dir=ddp-ctrl-c'],
        workdir, after_line='iter 3:', group=True, sig=signal.SIGINT)
    assert f'SIGINT: stopped after step {step} and saved' in output, output
    assert torch.load(workdir / 'ddp-ctrl-c' / 'ckpt.pt', weights_only=True)['iter_num'] == step
    assert 'stopped at once' not in output


def child_with_rank(pid, rank):
    """The torchrun worker process of the given rank, a child of pid (Linux /proc)."""
    for child in open(f'/proc/{pid}/task/{pid}/children').read().split():
        if f'RANK={rank}'.encode() in open(f'/proc/{child}/environ', 'rb').read().split(b'\0'):
            return int(child)
    raise AssertionError(f"no rank {rank} worker under {pid}")


def test_an_accumulation_the_processes_cannot_share_is_refused_before_they_join():
    from checkpoint import join_torchrun
    with pytest.raises(ValueError, match=r"^--gradient_accumulation_steps=3 must be a multiple of "
                                         r"the 2 processes, or at most 2$"):
        join_torchrun('cpu', 3, 2)


@pytest.mark.skipif(not os.path.exists('/proc/self/task'),
                    reason="finds the torchrun workers through /proc")
def test_torchrun_with_default_accumulation_runs_and_every_rank_stops_at_the_same_step(workdir):
    common = [TINY, '--lr_decay_iters=40', '--eval_interval=1000', '--log_interval=1',
              '--device=cpu']  # gloo
    # a SIGTERM to rank 1 alone: rank 0 learns it in the step's all-reduce, saves, and both exit
    # cleanly
    rc, output, step = start_and_stop(
        [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
         os.path.join(REPO, 'train.py'), *common, '--max_iters=100000', '--out_dir=ddp-default'],
        workdir, after_line='iter 3:', target=lambda pid: child_with_rank(pid, 1))
    assert rc == 0 and step is not None, output
    assert 'global batch 16 sequences = 8 x 1 micro-steps x 2 processes' in output
    # the same global batch as one process accumulating over 2 micro-steps
    single = run('train.py', *common, '--gradient_accumulation_steps=2', f'--max_iters={step}',
                 '--out_dir=ddp-single', cwd=workdir)
    assert (single.returncode == 0
            and 'global batch 16 sequences = 8 x 2 micro-steps' in single.stdout)
    a, b = (torch.load(workdir / d / 'ckpt.pt', weights_only=True)
            for d in ('ddp-default', 'ddp-single'))
    assert a['iter_num'] == b['iter_num'] == step
    for name, weight in a['model'].items():
        torch.testing.assert_close(weight, b['model'][name], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not os.path.exists('/proc/self/task'),
                    reason="finds the torchrun workers through /proc")
def test_a_rank_killed_under_torchrun_ends_the_job_with_one_line_and_the_last_checkpoint_resumes(
        workdir):
    common = [TINY, '--eval_interval=2', '--always_save_checkpoint=True', '--log_interval=1',
              '--device=cpu']
    proc = subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                             '--nproc_per_node=2', os.path.join(REPO, 'train.py'), *common,
                             '--max_iters=100000', '--out_dir=ddp-dead'],
                            cwd=workdir, env=OFFLINE_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    output = []
    for line in proc.stdout:
        output.append(line)
        if line.startswith('iter 5:'):
            os.kill(child_with_rank(proc.pid, 1), signal.SIGKILL)  # the OOM killer, say
            break
    output = ''.join(output + proc.stdout.readlines())
    assert proc.wait(timeout=HANG) != 0
    lines = [line for line in output.splitlines() if line.startswith('error: ')]
    assert (len(lines) == 1
            and lines[0].startswith('error: a process of this torchrun job is gone (')), output
    assert ('ddp-dead/ckpt.pt is left as it was (step ' in lines[0]
            and '--init_from=resume' in lines[0])
    assert 'train.py", line' not in output  # no traceback from inside the training script
    saved = torch.load(workdir / 'ddp-dead' / 'ckpt.pt', weights_only=True)['iter_num']
    resumed = run('train.py', *common, f'--max_iters={saved + 2}', '--init_from=resume',
                  '--out_dir=ddp-dead', cwd=workdir)
    assert resumed.returncode == 0 and f'iter {saved + 1}:' in resumed.stdout, resumed.stderr


def test_under_torchrun_a_bad_checkpoint_is_said_once(workdir):
    (workdir / 'bad.pt').write_bytes(b'garbage')
    result = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                             '--nproc_per_node=2', os.path.join(REPO, 'train.py'), TINY,
                             '--init_from=bad.pt', '--out_dir=ddp-bad', '--device=cpu'],
                            cwd=workdir, env=OFFLINE_ENV, capture_output=True, text=True,
                            timeout=HANG)
    errors = [line for line in (result.stdout + result.stderr).splitlines()
              if line.startswith('error: ')]
    assert result.returncode != 0  # every rank stops; rank 0 alone says why
    assert errors == ["error: bad.pt is not a torch checkpoint file; "
                      "give a ckpt.pt written by train.py"]


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="needs exactly one CUDA GPU")
def test_cuda_torchrun_with_more_processes_than_gpus_is_one_line():
    result = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                             '--nproc_per_node=2', os.path.join(REPO, 'train.py'), TINY,
                             '--device=cuda', '--out_dir=ddp-gpus'],
                            env=OFFLINE_ENV, capture_output=True, text=True, timeout=HANG)
    errors = [line for line in (result.stdout + result.stderr).splitlines()
              if line.startswith('error: ')]
    assert result.returncode != 0  # every rank stops; rank 0 alone says why
    assert errors == [
        "error: torchrun started more processes on this node than the 1 visible GPU(s): "
        "use --nproc_per_node=1, or --device=cpu (gloo)"]


def test_a_run_killed_in_the_middle_of_a_save_leaves_its_last_checkpoint_and_resumes(
        workdir, tmp_path):
    out = tmp_path / 'killed'
    common = [TINY, '--eval_interval=1', '--eval_iters=1', '--always_save_checkpoint=True',
              f'--out_dir={out}']
    # the first save is whole; the second is killed half-way through writing its checkpoint
    killed = run_on_a_full_disk('train.py', *common, '--max_iters=100', cwd=workdir,
                                target=r'ckpt\.pt\.\w+\.tmp$', limit=20_000, skip=1, kill=True)
    assert killed.returncode == -9
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 1 and 'model' in ckpt  # the last whole checkpoint
    assert len(list(out.glob('ckpt.pt.*.tmp'))) == 1  # the half-written one, under its own name
    resumed = run('train.py', *common, '--max_iters=3', '--init_from=resume', cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 3
    # the run that holds the folder clears what a killed one left
    assert not list(out.glob('*.tmp'))


# -----------------------------------------------------------------------------
# faults at the file system's edges: damaged data folders, a full disk,
# an out_dir that cannot be one

def test_a_damaged_data_folder_is_one_line_naming_the_file_and_the_command_that_rebuilds_it(
        workdir, tmp_path):
    good = workdir / 'data' / 'shakespeare_char'
    cases = {  # folder name -> (how to damage a copy of the built-in data, what the line must say)
        'truncated': (lambda d: os.truncate(d / 'train.bin', os.path.getsize(d / 'train.bin') - 1),
                      'train.bin is 8619291 bytes, not a whole number of uint16 tokens'),
        'no_meta': (lambda d: os.remove(d / 'meta.json'), 'meta.json is missing'),
        'no_val': (lambda d: os.remove(d / 'val.bin'), 'val.bin is missing'),
        'garbage_meta': (lambda d: (d / 'meta.json').write_bytes(os.urandom(64)),
                         'meta.json cannot be read'),
        'foreign_meta': (lambda d: (d / 'meta.json').write_text('{"vocab_size": 65}'),  # not ours
                         'meta.json is not a meta.json written by prepare.py'),
        'short': (lambda d: os.truncate(d / 'val.bin', 64),  # a context, but not its targets
                  'val.bin has 32 tokens, too few for block_size=32; use a smaller --block_size, '
                  'or more text (or, for val.bin, a larger prepare.py --val_fraction)'),
    }
    for name, (damage, message) in cases.items():
        folder = tmp_path / 'data' / name
        shutil.copytree(good, folder)
        damage(folder)
        line = one_error_line(run('train.py', TINY, f'--dataset={name}', '--out_dir=out',
                                  cwd=tmp_path))
        assert f"data/{name}/" in line and message in line, line
        if name != 'short':
            assert (f"`python prepare.py --text=FILE --dataset={name}` (or `--source=SOURCE`)"
                    in line), line
        assert not (tmp_path / 'out').exists()  # nothing written
    # the built-in data: its own command
    shutil.copytree(good, tmp_path / 'data' / 'shakespeare_char')
    os.remove(tmp_path / 'data' / 'shakespeare_char' / 'val.bin')
    line = one_error_line(run('train.py', TINY, '--out_dir=out', cwd=tmp_path))
    assert line.endswith(
        "val.bin is missing; rebuild it with `python prepare.py --dataset=shakespeare_char`"), line


# A file system that refuses writes to files whose name matches target after limit bytes (the
# first `skip` such files are written in full): as a disk that fills up, or a quota that runs out.
class Full:
    def __init__(self, f, limit, kill):
        self.f, self.written, self.limit, self.kill = f, 0, limit, kill

    def write(self, data):
        if self.written + len(data) > self.limit:
            self.f.write(data[:max(0, self.limit - self.written)])
            self.f.flush()
            if self.kill:  # the process is killed right here, in the middle of the write
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.written += len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)


def full_disk(target, limit, skip, kill):
    """In a script's process, before the script: open() gives such files."""
    import builtins
    real_open, opened = builtins.open, []

    def full_disk_open(file, mode='r', *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if re.search(target, str(file)) and ('w' in mode or 'a' in mode):
            opened.append(file)
            return f if len(opened) <= skip else Full(f, limit, kill)
        return f
    builtins.open = full_disk_open


def run_on_a_full_disk(script, *args, cwd, target, limit=1000, skip=0, kill=False):
    """kill=True: the process is killed (SIGKILL) where the write would fail."""
    return run(script, *args, cwd=cwd, before=partial(full_disk, target, limit, skip, kill))


@pytest.mark.parametrize("target", [r'ckpt\.pt\.\w+\.tmp$', r'log\.jsonl$'])
def test_a_full_disk_stops_the_run_with_one_line_and_keeps_the_last_good_checkpoint(
        workdir, tmp_path, target):
    out = tmp_path / 'full'
    shutil.copytree(workdir / 'run', out)  # a checkpoint at step 10
    before = (out / 'ckpt.pt').read_bytes()
    common = [TINY, '--init_from=resume', '--max_iters=30', '--eval_interval=5',
              '--always_save_checkpoint=True', f'--out_dir={out}']
    line = one_error_line(run_on_a_full_disk('train.py', *common, cwd=workdir, target=target))
    assert f"could not write {out}/{'ckpt.pt' if target.startswith('ckpt') else 'log.jsonl'} " \
           f"(No space left on device)" in line, line
    assert (f"{out}/ckpt.pt is left as it was (step 10)" in line
            and '--init_from=resume' in line), line
    assert (out / 'ckpt.pt').read_bytes() == before and not list(out.glob('*.tmp'))
    assert all(json.loads(record) for record in open(out / 'log.jsonl'))  # no half-written line
    resumed = run('train.py', *common, cwd=workdir)  # space again: it continues from step 10
    assert resumed.returncode == 0, resumed.stderr
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 30


def test_prepare_on_a_full_disk_leaves_no_half_written_file(tmp_path):
    line = one_error_line(run_on_a_full_disk('prepare.py', cwd=tmp_path, target=r'\.bin\.\w+\.tmp$',
                                             limit=10_000))
    assert line == ("error: could not write data/shakespeare_char/ (No space left on device); "
                    "free some space, or give another --dataset, and run prepare.py again")
    assert os.listdir(tmp_path / 'data' / 'shakespeare_char') == []


def test_an_out_dir_that_cannot_be_one_is_said_before_anything_runs(workdir, tmp_path):
    (tmp_path / 'afile').write_text('not a folder')
    for out_dir, message in ((tmp_path / 'afile', 'exists and is not a folder'),
                             (tmp_path / 'afile' / 'run',
                              f'cannot be created ({tmp_path}/afile is not a folder)'),
                             ('/proc/run', 'cannot be written (/proc: ')):  # even for root
        line = one_error_line(run('train.py', TINY, f'--out_dir={out_dir}', cwd=workdir))
        assert line.startswith(f"error: --out_dir={out_dir} {message}"), line
        assert line.endswith("; give another --out_dir"), line


# -----------------------------------------------------------------------------
# between processes and runs

def test_a_log_cut_off_mid_line_is_read_around_and_cut_back_when_the_run_resumes(workdir, tmp_path):
    import plot
    out = tmp_path / 'cut'
    shutil.copytree(workdir / 'run', out)
    log = out / 'log.jsonl'
    whole = log.read_text()
    log.write_text(whole + '{"event": "train", "iter": 11, "ce": 2.')  # killed while appending
    assert plot.load_run(str(out))['final']['iter'] == 10  # the figures: from the whole records
    resumed = run('train.py', TINY, f'--out_dir={out}', '--init_from=resume', '--max_iters=12',
                  cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert (f"note: {log} ended in a line cut off mid-write; cut it back to its last whole line"
            in resumed.stdout)
    text = log.read_text()
    records = [json.loads(line) for line in text.splitlines()]  # every line whole again
    assert text.startswith(whole) and records[-1]['event'] == 'done' and records[-1]['iter'] == 12


def test_a_second_run_into_a_live_run_s_out_dir_is_refused_and_a_killed_run_holds_nothing(workdir):
    out = workdir / 'live'
    first = subprocess.Popen([sys.executable, os.path.join(REPO, 'train.py'), TINY,
                              '--out_dir=live', '--max_iters=100000', '--eval_interval=100000'],
                             cwd=workdir, env=OFFLINE_ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + HANG
        while (not ((out / 'run.lock').exists() and (out / 'run.lock').read_text())
               and time.time() < deadline):
            time.sleep(0.2)
        for how in ('--overwrite=True', '--init_from=resume'):
            line = one_error_line(run('train.py', TINY, '--out_dir=live', how, cwd=workdir))
            assert line.startswith(
                f"error: --out_dir=live is in use by a live run (pid {first.pid} on host "), line
            assert 'wait for it to end or stop it, or give another --out_dir' in line
        while not (out / 'log.jsonl').exists() and time.time() < deadline:
            time.sleep(0.2)
        # an evaluation writes nothing into a run's folder, so the live one is no obstacle
        evaluated = run('train.py', TINY, '--out_dir=live', '--eval_only=True',
                        f"--init_from={workdir / 'run' / 'ckpt.pt'}", cwd=workdir)
        assert evaluated.returncode == 0 and 'val ce' in evaluated.stdout, evaluated.stderr
    finally:
        first.kill()  # SIGKILL: no chance to let go of anything itself
        first.wait()
    assert (out / 'run.lock').read_text().startswith(f'pid {first.pid} ')  # its file stays ...
    again = run('train.py', TINY, '--out_dir=live', '--overwrite=True', '--max_iters=2',
                cwd=workdir)
    assert again.returncode == 0, again.stderr  # ... but the kernel's lock went with the process


# -----------------------------------------------------------------------------
# files from elsewhere: a data folder runs no code, its ids fit its vocabulary,
# a checkpoint its data

class RunsCode:
    """What a shared meta.pkl can be made to do the moment pickle.load reads it: run code."""
    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').write('ran')",))


def test_a_data_folder_is_read_as_json_only_so_a_pickle_made_to_run_code_runs_none(
        workdir, tmp_path):
    import pickle
    evil = tmp_path / 'data' / 'evil'
    shutil.copytree(workdir / 'data' / 'shakespeare_char', evil)
    os.remove(evil / 'meta.json')  # as nanoGPT's folders, or someone else's: a meta.pkl instead
    (evil / 'meta.pkl').write_bytes(
        pickle.dumps(dict(tokenizer='char', vocab_size=76, x=RunsCode())))
    line = one_error_line(run('train.py', TINY, '--dataset=evil', '--out_dir=out', cwd=tmp_path))
    assert 'data/evil/meta.json is missing' in line
    assert '`python prepare.py --text=FILE --dataset=evil` (or `--source=SOURCE`)' in line
    assert not (tmp_path / 'PWNED').exists() and not (tmp_path / 'out').exists()
    line = one_error_line(run('sample.py', '--out_dir=out', cwd=tmp_path))  # nor does sample.py
    assert not (tmp_path / 'PWNED').exists()


def test_token_ids_past_the_vocabulary_are_one_line_naming_the_file_the_id_and_the_command(
        workdir, tmp_path):
    import numpy as np
    # a GPT-2 id in a character folder (another tokenizer wrote it), and the first id past 75
    for name, bad in (('mixed', 50256), ('one_past', 76)):
        folder = tmp_path / 'data' / name
        shutil.copytree(workdir / 'data' / 'shakespeare_char', folder)
        ids = np.fromfile(folder / 'train.bin', dtype=np.uint16)
        ids[123_456] = bad
        ids.tofile(folder / 'train.bin')
        line = one_error_line(run('train.py', TINY, f'--dataset={name}', '--out_dir=out',
                                  cwd=tmp_path))
        assert (f'data/{name}/train.bin holds token id {bad}, past the vocabulary of 76 ids in '
                f'meta.json' in line)
        assert f'`python prepare.py --text=FILE --dataset={name}`' in line


def test_fine_tuning_on_data_whose_same_size_vocabulary_means_other_characters_is_one_line(
        workdir, tmp_path):
    shuffled = tmp_path / 'data' / 'shuffled'
    shutil.copytree(workdir / 'data' / 'shakespeare_char', shuffled)
    meta = json.load(open(shuffled / 'meta.json'))
    # the same 76 ids, other characters: another text's vocabulary
    meta['itos'] = meta['itos'][::-1]
    (shuffled / 'meta.json').write_text(json.dumps(meta))
    line = one_error_line(run('train.py', TINY, '--dataset=shuffled',
                              f"--init_from={workdir / 'run' / 'ckpt.pt'}", '--out_dir=ft',
                              cwd=tmp_path))
    assert ("was trained on another vocabulary than data/shuffled's (the same 76 ids stand for "
            "other characters); use the dataset it was trained on (--dataset=shakespeare_char)"
            in line)
    assert not (tmp_path / 'ft').exists()
    # one character more: another vocabulary size
    bigger = tmp_path / 'data' / 'bigger'
    shutil.copytree(workdir / 'data' / 'shakespeare_char', bigger)
    meta = json.load(open(bigger / 'meta.json'))
    meta.update(itos=meta['itos'] + ['€'], vocab_size=77)
    (bigger / 'meta.json').write_text(json.dumps(meta))
    line = one_error_line(run('train.py', TINY, '--dataset=bigger',
                              f"--init_from={workdir / 'run' / 'ckpt.pt'}", '--out_dir=ft',
                              cwd=tmp_path))
    assert line.endswith("has vocab_size=76, but data/bigger has 77; use the dataset it was "
                         "trained on (--dataset=shakespeare_char)"), line
    assert not (tmp_path / 'ft').exists()


# -----------------------------------------------------------------------------
# a run's files belong to the run

def test_an_evaluation_never_writes_into_the_run_it_reads(workdir, tmp_path):
    out = tmp_path / 'done'
    shutil.copytree(workdir / 'run', out)
    before = {name: (out / name).read_bytes() for name in ('ckpt.pt', 'log.jsonl')}
    for args in (['--init_from=resume', '--router=seqtopk'],  # resumed at its last step
                 [],  # the run's own checkpoint: out_dir's run, as given
                 [f'--init_from={out}/ckpt.pt', '--router=batchtopk']):
        result = run('train.py', TINY, f'--out_dir={out}', '--eval_only=True', *args, cwd=workdir)
        assert result.returncode == 0 and 'val ce' in result.stdout, result.stderr
        assert {name: (out / name).read_bytes() for name in before} == before
        assert (sorted(os.listdir(out))
                == ['ckpt.pt', 'log.jsonl', 'run.lock'][:len(os.listdir(out))])
    # asked to, it writes its numbers into a folder of its own: a log, marked an evaluation
    result = run('train.py', TINY, f'--init_from={out}/ckpt.pt', '--eval_only=True',
                 '--router=seqtopk', f'--out_dir={tmp_path}/eval', cwd=workdir)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in open(tmp_path / 'eval' / 'log.jsonl')]
    assert [r['event'] for r in records] == ['start', 'eval', 'done']
    assert records[0]['eval_only'] and records[-1]['eval_only'] and records[-1]['iter'] == 10
    assert not (tmp_path / 'eval' / 'ckpt.pt').exists()


def test_an_evaluation_of_a_checkpoint_uses_its_run_s_val_batches_and_repeats_its_number(
        workdir, tmp_path):
    # README's "evaluate another way": a run with its own batch size and eval_iters, evaluated
    # the same way, gives the val CE its log holds, on the same batches
    out = tmp_path / 'own'
    trained = run('train.py', TINY, f'--out_dir={out}', '--max_iters=4', '--batch_size=3',
                  '--eval_iters=3', '--eval_interval=4', cwd=workdir)
    assert trained.returncode == 0, trained.stderr
    logged = [r for r in map(json.loads, open(out / 'log.jsonl')) if 'val_ce' in r][-1]['val_ce']
    result = run('train.py', f'--init_from={out}/ckpt.pt', '--eval_only=True', cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert f"val ce {logged:.4f}" in result.stdout, (logged, result.stdout)
    assert 'global batch 3 sequences' in result.stdout


def test_an_evaluation_without_init_from_evaluates_the_run_in_out_dir_or_is_refused(workdir,
                                                                                   tmp_path):
    # it evaluated an untrained model and printed a plausible number (4.34 against the run's 3.66)
    logged = [r for r in map(json.loads, open(workdir / 'run' / 'log.jsonl'))
              if 'val_ce' in r][-1]['val_ce']
    result = run('train.py', TINY, '--out_dir=run', '--eval_only=True', cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "step 10: train ce" in result.stdout and f"val ce {logged:.4f}" in result.stdout
    line = one_error_line(run('train.py', TINY, f'--out_dir={tmp_path}/none', '--eval_only=True',
                              cwd=workdir))
    assert line == (f"error: --eval_only=True evaluates a checkpoint and {tmp_path}/none/ holds "
                    f"none; give --init_from=PATH/ckpt.pt, or the --out_dir of a run")
    assert not os.path.exists(tmp_path / 'none')


def test_an_overwritten_run_stopped_before_its_first_save_never_resumes_the_old_checkpoint(
        workdir, tmp_path):
    out = tmp_path / 'over'
    shutil.copytree(workdir / 'run', out)  # a finished run: its checkpoint at step 10
    old_id = json.loads(open(out / 'log.jsonl').readline())['run_id']
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, 'train.py'), TINY,
                             f'--out_dir={out}', '--overwrite=True', '--max_iters=100000',
                             '--eval_interval=100000', '--log_interval=1'],
                            cwd=workdir, env=OFFLINE_ENV, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith('iter 2:'):
            proc.kill()  # an OOM kill or a preemption without notice: no save
            break
    proc.wait()
    assert not (out / 'ckpt.pt').exists()  # the old run's checkpoint was moved out of the way first
    [moved] = os.listdir(out / 'replaced')  # a folder of its own
    assert sorted(os.listdir(out / 'replaced' / moved)) == ['ckpt.pt', 'log.jsonl']
    assert json.loads(open(out / 'log.jsonl').readline())['run_id'] != old_id
    line = one_error_line(run('train.py', TINY, f'--out_dir={out}', '--init_from=resume',
                              cwd=workdir))
    assert 'there is no checkpoint at' in line and '--overwrite=True' in line
    # a checkpoint left beside another run's log (moved back by hand, or by an older seqmoe):
    # refused
    shutil.copy(out / 'replaced' / moved / 'ckpt.pt', out / 'ckpt.pt')
    line = one_error_line(run('train.py', TINY, f'--out_dir={out}', '--init_from=resume',
                              cwd=workdir))
    assert f"{out}/ckpt.pt is not the checkpoint of the run in {out}/log.jsonl" in line, line
    # and a run whose log exists without a checkpoint is a run all the same: not replaced silently
    os.remove(out / 'ckpt.pt')
    line = one_error_line(run('train.py', TINY, f'--out_dir={out}', cwd=workdir))
    assert line.endswith("already holds a run that saved no checkpoint; pass --overwrite=True to "
                         "start it again, or pick another --out_dir"), line
    # replaced again: the run replaced first is still there, beside the second
    again = run('train.py', TINY, f'--out_dir={out}', '--overwrite=True', '--max_iters=0',
                cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert len(os.listdir(out / 'replaced')) == 2
    assert torch.load(out / 'replaced' / moved / 'ckpt.pt', weights_only=True)['iter_num'] == 10


# -----------------------------------------------------------------------------
# settings checked as the run will use them: a resumed run's merged with its checkpoint's

def test_a_resumed_run_s_settings_are_checked_as_merged_with_its_checkpoint(workdir, tmp_path):
    out = tmp_path / 'wide'
    first = run('train.py', TINY, '--n_exp=16', '--max_iters=2', f'--out_dir={out}', cwd=workdir)
    assert first.returncode == 0, first.stderr
    # no --n_exp here (the command line's default is 8): k=12 fits the checkpoint's 16 experts
    model = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--exp_dim=32', '--block_size=32']
    again = run('train.py', *model, '--batch_size=4', '--eval_iters=1', '--k_schedule=0:12',
                '--max_iters=4', '--log_interval=1',
                '--init_from=resume', f'--out_dir={out}', cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert [r['experts'] for r in map(json.loads, open(out / 'log.jsonl'))
            if r['event'] == 'train'][-1] == 12.0
    assert "between 1 and --n_exp=16" in one_error_line(run(
        'train.py', *model, '--k_schedule=0:17', '--max_iters=6', '--init_from=resume',
        f'--out_dir={out}', cwd=workdir))
    # the data is checked against the context that trains: the checkpoint's 32 tokens, not the
    # default 128
    short = tmp_path / 'data' / 'short'
    os.makedirs(short)
    for name in ('train.bin', 'val.bin'):
        (short / name).write_bytes(
            (workdir / 'data' / 'shakespeare_char' / name).read_bytes()[:200])
    shutil.copy(workdir / 'data' / 'shakespeare_char' / 'meta.json', short)
    tuned = run('train.py', '--dataset=short', f"--init_from={workdir / 'run' / 'ckpt.pt'}",
                '--max_iters=2', '--eval_iters=1', '--batch_size=2', f'--out_dir={tmp_path}/ft',
                cwd=tmp_path)
    assert tuned.returncode == 0, tuned.stderr


def test_resuming_with_another_router_measures_its_best_val_loss_afresh(workdir, tmp_path):
    out = tmp_path / 'switch'
    shutil.copytree(workdir / 'run', out)
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    torch.save(dict(ckpt, best_val_loss=0.0), out / 'ckpt.pt')  # a best no evaluation can beat
    common = [TINY, f'--out_dir={out}', '--init_from=resume', '--eval_interval=2', '--max_iters=14']
    result = run('train.py', *common, '--router=seqtopk', cwd=workdir)
    assert result.returncode == 0, result.stderr
    evals = [r for r in map(json.loads, open(out / 'log.jsonl'))
             if r['event'] == 'eval' and r['iter'] > 10]
    saved = torch.load(out / 'ckpt.pt', weights_only=True)
    # seqtopk's own best
    assert saved['best_val_loss'] == pytest.approx(min(r['val_ce'] for r in evals))
    assert saved['model_args']['router'] == 'seqtopk'


def test_two_runs_on_a_fresh_machine_prepare_the_built_in_data_once_between_them(tmp_path):
    runs = [subprocess.Popen([sys.executable, os.path.join(REPO, 'train.py'), TINY, '--max_iters=2',
                              f'--out_dir=out{i}'],
                             cwd=tmp_path, env=OFFLINE_ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [proc.communicate(timeout=HANG) for proc in runs]
    assert all(proc.returncode == 0 for proc in runs), outputs
    # the other waited
    assert sum('preparing the built-in dataset' in out for out, _ in outputs) == 1
    assert (sorted(os.listdir(tmp_path / 'data' / 'shakespeare_char'))
            == ['meta.json', 'train.bin', 'val.bin'])
