"""
A training run's files: the data it reads, and the ckpt.pt and log.jsonl it writes, each whole,
in the out_dir it holds. A checkpoint loads with weights_only=True, and anything wrong with it is
one line; a Run stops every rank at the same step, its last good checkpoint kept.
"""
import fcntl
import glob
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager, suppress
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from configurator import fail
from model import ARCHITECTURE, GPTConfig

MODEL_KEYS = [f.name for f in fields(GPTConfig)]  # the settings a checkpoint's model_args hold
MODEL_TYPES = {f.name: f.type for f in fields(GPTConfig)}
ROUTING_KEYS = set(MODEL_KEYS) - set(ARCHITECTURE)  # those that may change on resume or fine-tune
BUILTIN = {'shakespeare_char': [], 'shakespeare': ['--tokenizer=gpt2']}  # prepare.py's arguments
DEFAULT_DATASET = 'shakespeare_char'
LOCK = 'run.lock'  # in out_dir: held by the run that writes there, with its pid and start
HELD = []  # the lock files this process holds, open until it exits


def code_version():
    """This code's commit ('1a2b3c4', '+dirty' with uncommitted changes); None outside git."""
    try:  # the short hash, every tag excluded
        git = subprocess.run(['git', '-C', os.path.dirname(os.path.abspath(__file__)), 'describe',
                              '--always', '--dirty=+dirty', '--exclude=*'],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return None if git.returncode else git.stdout.strip()


def non_finite(state_dict):  # the names of the tensors holding a NaN or an inf
    return [name for name, t in state_dict.items()
            if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all()]


# -----------------------------------------------------------------------------
# the data a run reads: prepare.py's folders, data/<dataset>

def rebuild_command(data_dir):  # the prepare.py command that makes data_dir
    name = os.path.basename(os.path.normpath(data_dir))
    if name in BUILTIN:
        return f"`{' '.join(['python prepare.py', *BUILTIN[name], f'--dataset={name}'])}`"
    return f"`python prepare.py --text=FILE --dataset={name}` (or `--source=SOURCE`)"


def on_first_use(dataset, data_dir):
    """Prepare a built-in dataset the first time a run asks for it, one process at a time;
    ValueError for any other that is missing."""
    whole = os.path.join(data_dir, 'meta.json')  # written last: the folder is whole
    if os.path.exists(whole) or dataset not in BUILTIN and os.path.exists(data_dir):
        return  # check_data says what is missing
    if dataset not in BUILTIN:
        raise ValueError(f"no data in {data_dir}/; make it with {rebuild_command(data_dir)}, or "
                         f"use the built-in --dataset={DEFAULT_DATASET}")
    os.makedirs(os.path.dirname(os.path.abspath(data_dir)), exist_ok=True)
    lock(data_dir + '.lock', wait=True)
    if not os.path.exists(whole):
        print(f"preparing the built-in dataset '{dataset}' in {data_dir}/", flush=True)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'prepare.py')
        made = subprocess.run([sys.executable, script, *BUILTIN[dataset], f'--dataset={dataset}'],
                              stdout=sys.stdout, stderr=subprocess.PIPE, text=True)
        if made.returncode:
            raise ValueError(made.stderr.strip().splitlines()[-1].removeprefix('error: '))


def check_data(data_dir, block_size):
    """The meta.json of a data folder prepare.py made, after checking train.bin and val.bin:
    whole uint16 tokens, more than block_size + 1, every id in the vocabulary. Else ValueError:
    the file, what is wrong, the command that rebuilds it."""
    redo = f"rebuild it with {rebuild_command(data_dir)}"
    path = os.path.join(data_dir, 'meta.json')
    for name in ('train.bin', 'val.bin', 'meta.json'):
        if not os.path.isfile(os.path.join(data_dir, name)):
            raise ValueError(f"{os.path.join(data_dir, name)} is missing; {redo}")
    try:  # JSON: a data folder from elsewhere cannot run code
        meta = json.load(open(path, encoding='utf-8'))
    except Exception as e:  # any unreadable file: one line, not a traceback
        raise ValueError(f"{path} cannot be read ({type(e).__name__}); {redo}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get('vocab_size'), int) or \
            meta.get('tokenizer') not in ('char', 'gpt2') or \
            meta['tokenizer'] == 'char' and not isinstance(meta.get('itos'), list):
        raise ValueError(f"{path} is not a meta.json written by prepare.py (it needs a tokenizer, "
                         f"'char' or 'gpt2', and its vocab_size); {redo}")
    if meta['tokenizer'] == 'char':
        meta['itos'] = dict(enumerate(meta['itos']))
        meta['stoi'] = {ch: i for i, ch in meta['itos'].items()}
    for split in ('train', 'val'):
        path = os.path.join(data_dir, f'{split}.bin')
        size = os.path.getsize(path)
        if size % 2:
            raise ValueError(f"{path} is {size} bytes, not a whole number of uint16 tokens; {redo}")
        if size // 2 <= block_size + 1:
            raise ValueError(f"{path} has {size // 2} tokens, too few for block_size={block_size}; "
                             f"use a smaller --block_size, or more text (or, for val.bin, a "
                             f"larger prepare.py --val_fraction)")
        ids, step = np.memmap(path, dtype=np.uint16, mode='r'), 1 << 26  # ids from elsewhere?
        largest = max(int(ids[i:i + step].max()) for i in tqdm(
            range(0, len(ids), step), desc=f'checking {path}', disable=len(ids) <= step))
        if largest >= meta['vocab_size']:
            raise ValueError(f"{path} holds token id {largest}, past the vocabulary of "
                             f"{meta['vocab_size']} ids in meta.json (another tokenizer wrote it); "
                             f"{redo}")
    return meta


def get_batch(data, block_size, batch_size, generator, draws=1, take=0):
    """(x, y) (batch_size, block_size): sequences at random offsets of a split's ids and their
    next tokens. `draws` sets of offsets drawn (one per DDP rank), set `take` used: N processes
    see what one would."""
    offsets = [torch.randint(len(data) - block_size, (batch_size,), generator=generator)
               for _ in range(draws)][take].tolist()
    return tuple(torch.stack([torch.from_numpy(data[i + s:i + s + block_size].astype(np.int64))
                              for i in offsets]) for s in (0, 1))


# -----------------------------------------------------------------------------
# files written whole, logs appended whole, folders held by one process

@contextmanager
def written(path):
    """A temporary path of this writer's own, renamed to path when the block ends, removed if it
    fails: a kill or a full disk never leaves half a file."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or '.',
                               prefix=os.path.basename(path) + '.', suffix='.tmp')
    os.close(fd)
    umask = os.umask(0o022)  # read it (setting it is the only way), then put it back
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as open() would make it, not mkstemp's owner-only
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        with suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError):  # a write error names no file: name the one it was for
            raise OSError(e.errno, e.strerror or str(e), path) from None
        raise


def save(ckpt, path):
    """torch.save through written(), on disk before the rename; OSError naming path if refused."""
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)  # in memory first: a failed write is then an OSError that says why
    with written(path) as tmp, open(tmp, 'wb') as f:
        f.write(buffer.getbuffer())
        f.flush()
        os.fsync(f.fileno())


def append_line(path, line):
    """Append a line to a log, first cutting away a last line a killed run left half-written."""
    size = os.path.getsize(path) if os.path.exists(path) else 0
    if size:
        with open(path, 'rb') as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b'\n':
                f.seek(0)
                size = f.read().rfind(b'\n') + 1
                os.truncate(path, size)
                print(f"note: {path} ended in a line cut off mid-write; cut it back to its last "
                      f"whole line")
    try:
        with open(path, 'a') as f:
            f.write(line + '\n')
    except OSError:
        with suppress(OSError):
            os.truncate(path, size)
        raise


def read_run(out_dir):
    """A run's log.jsonl by event, {'eval': [...], ...} ([] for one it lacks), lines that are not
    whole records skipped with a note; None without one."""
    path = os.path.join(out_dir, 'log.jsonl')
    if not os.path.exists(path):
        return None
    def record(line):
        with suppress(ValueError):
            return json.loads(line)
    lines = list(filter(str.strip, open(path, encoding='utf-8', errors='replace')))
    records = defaultdict(list)
    for r in map(record, lines):
        if isinstance(r, dict):
            records[r.get('event')].append(r)
    if skipped := len(lines) - sum(map(len, records.values())):
        print(f"note: {path}: skipped {skipped} line(s) that are not whole records",
              file=sys.stderr)
    return records


def lock(path, wait=False):
    """Hold the kernel's lock (flock) on path until this process exits (a dead process holds
    nothing: no stale locks); False when another holds it (wait=True: wait)."""
    f = open(path, 'a+')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        f.close()
        return False
    f.truncate(0)
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}, since {time.strftime('%F %T')}")
    f.flush()
    HELD.append(f)
    return True


def lock_holder(path):
    """Who holds the lock at path ('pid P on host H, since T'), or None."""
    if not os.path.exists(path) or any(f.name == path for f in HELD):
        return None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or 'just started'


def in_use(path, what):  # why a folder whose lock (at path) a live run or sweep holds is refused
    return (f"is in use by a live {what} ({lock_holder(path) or 'just ended'}); wait for it to end "
            f"or stop it, or give another --out_dir")


# -----------------------------------------------------------------------------
# loading a checkpoint: one line for whatever is wrong with it

def load(path, state=(), quiet=False):
    """The checkpoint dict at path (model, model_args, meta and `state`), or one error line (quiet:
    exit 1, as torchrun's other ranks do). On the CPU: the RNG states must stay CPU tensors."""
    def refuse(why):
        fail(f"{path} {why}", quiet)
    if os.path.getsize(path) == 0:
        refuse("is empty, not a checkpoint")
    try:
        with warnings.catch_warnings():  # torch warns about odd pickles; the line below says enough
            warnings.simplefilter('ignore')
            ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # torch raises many kinds; what the user needs is which file and why
        if refused := re.search(r'Unsupported global: GLOBAL (\S+)', str(e)):
            refuse(f"holds Python objects ({refused.group(1)}) that safe loading "
                   f"(weights_only=True) refuses; it was not written by seqmoe's train.py")
        if open(path, 'rb').read(4) == b'PK\x03\x04':  # what torch.save writes
            refuse("is truncated or corrupt (torch cannot read it as a checkpoint archive); use "
                   "another checkpoint or train again")
        refuse("is not a torch checkpoint file; give a ckpt.pt written by train.py")
    if not isinstance(ckpt, dict):
        refuse(f"holds a {type(ckpt).__name__}, not a checkpoint; give a ckpt.pt from train.py")
    args, meta = ckpt.get('model_args'), ckpt.get('meta')
    if isinstance(args, dict) and not {'n_exp', 'router'} <= set(args):
        refuse("is a dense GPT checkpoint from another project (nanoGPT?): its model_args have no "
               "n_exp or router; seqmoe loads only checkpoints written by its own train.py")
    if missing := [k for k in ('model', 'model_args', 'meta', *state) if k not in ckpt]:
        refuse(f"is not a complete seqmoe checkpoint: it has no {', '.join(missing)} "
               f"(it has {', '.join(map(str, ckpt)) or 'nothing'})")
    if isinstance(args, dict):
        args.pop('moe_impl', None)  # a model setting once, since a choice of the scripts
    if not isinstance(args, dict) or set(args) - set(MODEL_KEYS):
        unknown = sorted(set(args) - set(MODEL_KEYS)) if isinstance(args, dict) else ['(no dict)']
        refuse(f"has model settings this version does not know: {', '.join(unknown)}")
    if wrong := [k for k, v in args.items() if type(v) is not MODEL_TYPES[k] and not (
            MODEL_TYPES[k] is float and type(v) is int)]:  # a float setting: an int too
        refuse(f"has a model setting of the wrong type: {wrong[0]}={args[wrong[0]]!r}, not "
               f"{MODEL_TYPES[wrong[0]].__name__}; give a ckpt.pt written by train.py")
    if not (isinstance(meta, dict) and {'tokenizer', 'vocab_size'} <= set(meta)):
        refuse("has no tokenizer in its meta; give a ckpt.pt written by train.py")
    if not isinstance(ckpt['model'], dict):
        refuse("has no weights (its 'model' is not a state dict)")
    if bad := non_finite(ckpt['model']):
        refuse(f"holds non-finite weights (NaN or inf in {bad[0]}); it cannot be used")
    return ckpt


def load_to_continue(source, resume, model_args, overridden, quiet=False):
    """The checkpoint a run resumes or fine-tunes from, and the model settings merged: the saved
    ones, but those the command line gives (only routing may differ); else ValueError."""
    if not os.path.isfile(source):
        raise ValueError(f"--init_from=resume but there is no checkpoint at {source}; start the "
                         f"run again (--overwrite=True replaces what its folder holds), or give "
                         f"the --out_dir of the run")
    state = ('optimizer', 'iter_num', 'best_val_loss', 'batch_gen_state', 'torch_rng_state')
    checkpoint = load(source, state if resume else (), quiet)
    saved = checkpoint['model_args']
    for k, value in saved.items():
        if k in overridden and k not in ROUTING_KEYS and model_args.get(k) != value:
            raise ValueError(f"{source} was trained with {k}={value!r}, this run asks for "
                             f"{k}={model_args[k]!r}; drop --{k} (on the command line or in a "
                             f"preset), or train from scratch in another --out_dir")
    return checkpoint, {**model_args, **{k: v for k, v in saved.items() if k not in overridden}}


def check_vocabulary(checkpoint, source, meta, data_dir):
    """ValueError unless the data's vocabulary is the one the checkpoint was trained on."""
    again = f"use the dataset it was trained on (--dataset={checkpoint.get('dataset')})"
    if checkpoint['model_args'].get('vocab_size') != meta['vocab_size']:
        raise ValueError(f"{source} has vocab_size={checkpoint['model_args'].get('vocab_size')}, "
                         f"but {data_dir} has {meta['vocab_size']}; {again}")
    saved = checkpoint['meta']
    if (saved.get('tokenizer'), saved.get('itos')) != (meta['tokenizer'], meta.get('itos')):
        what = (f"its tokenizer is {saved.get('tokenizer')}, the data's {meta['tokenizer']}"
                if saved.get('tokenizer') != meta['tokenizer'] else
                f"the same {meta['vocab_size']} ids stand for other characters")
        raise ValueError(f"{source} was trained on another vocabulary than {data_dir}'s "
                         f"({what}); {again}")


def restore_state(checkpoint, source, optimizer, batch_gen, quiet=False):
    """A resumed run's optimizer, batch stream and RNG as the checkpoint left them, or one line."""
    try:
        optimizer.load_state_dict(checkpoint['optimizer'])
        batch_gen.set_state(checkpoint['batch_gen_state'])
        torch.set_rng_state(checkpoint['torch_rng_state'])
    except (ValueError, RuntimeError, TypeError, KeyError) as e:
        fail(f"{source} has an optimizer or RNG state this run cannot restore "
             f"({type(e).__name__}); fine-tune from it instead: --init_from={source} "
             f"--out_dir=ANOTHER_DIR", quiet)


def load_weights(model, ckpt, path, quiet=False):
    """model.load_state_dict, or one line naming the keys that do not fit. A router's buffers
    are its own: another router's are ignored, and those it lacks start afresh."""
    try:
        result = model.load_state_dict(ckpt['model'], strict=False)
        missing = [k for k in result.missing_keys if k not in dict(model.named_buffers())]
        unexpected = [k for k in result.unexpected_keys if '.router.' not in k]
        why = (f"missing {', '.join(missing[:3]) or 'none'}, unexpected "
               f"{', '.join(unexpected[:3]) or 'none'}" if missing or unexpected else None)
    except RuntimeError as e:  # a shape mismatch
        why = next((line.strip() for line in str(e).splitlines() if 'size mismatch' in line),
                   str(e))[:200]
    if why:
        fail(f"{path} has weights that do not fit its model_args ({why})", quiet)


# -----------------------------------------------------------------------------
# the run: its processes, its folder, how it stops on every rank at once

def join_torchrun(device, accumulation, world_size):
    """Join torchrun's process group (NCCL on GPUs, gloo on the CPU); this rank's device and its
    share of the gradient accumulation steps, or ValueError."""
    if accumulation > world_size and accumulation % world_size:
        raise ValueError(f"--gradient_accumulation_steps={accumulation} must be a multiple of the "
                         f"{world_size} processes, or at most {world_size}")
    if device.startswith('cuda'):
        local_rank, gpus = int(os.environ['LOCAL_RANK']), torch.cuda.device_count()
        if int(os.environ.get('LOCAL_WORLD_SIZE', local_rank + 1)) > gpus:
            raise ValueError(f"torchrun started more processes on this node than the {gpus} "
                             f"visible GPU(s): use --nproc_per_node={gpus}, or --device=cpu (gloo)")
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend='nccl' if device.startswith('cuda') else 'gloo')
    return device, max(1, accumulation // world_size)  # below one each, every rank runs one


class Run:
    """A training run's folder and how the run stops. Rank 0 writes out_dir's log.jsonl and
    ckpt.pt (write=False: nothing). The first write refused (disk full, I/O error) is kept in
    `error` and nothing more is written. Every rank stops at the same step (one all-reduce of
    the flags), its last good checkpoint (step `saved_iter`) kept, rank 0 saying in one line
    why and how to go on; after listen(), SIGTERM or SIGINT (Ctrl-C) stops it after its step."""

    def __init__(self, out_dir, ddp, master, world_size, settings):
        self.out_dir, self.write, self.ddp, self.master = out_dir, master, ddp, master
        self.world_size, self.settings = world_size, settings  # the run's, as they go
        self.log_path, self.ckpt_path, self.lock_path = (
            os.path.join(out_dir, name) for name in ('log.jsonl', 'ckpt.pt', LOCK))
        self.saved_iter = self.error = self.signal = self.wandb = None
        self.signal_at = 0.0  # when the first signal came: torchrun passes a Ctrl-C on, too

    # its folder and files

    def out_dir_problem(self):
        """Why out_dir cannot hold this run (None when it can), found before anything runs."""
        if os.path.isdir(self.out_dir) and lock_holder(self.lock_path):
            return in_use(self.lock_path, 'run')
        if os.path.exists(self.out_dir) and not os.path.isdir(self.out_dir):
            return "exists and is not a folder; give another --out_dir"
        there = os.path.abspath(self.out_dir)  # out_dir, or the folder it will be made in
        while not os.path.exists(there):
            there = os.path.dirname(there)
        if not os.path.isdir(there):
            return f"cannot be created ({there} is not a folder); give another --out_dir"
        try:  # what the file system says, even to root (read-only mounts, immutable folders)
            tempfile.TemporaryFile(dir=there).close()
        except OSError as e:
            return f"cannot be written ({there}: {e.strerror or e}); give another --out_dir"

    def holds_run(self):
        """Whether out_dir holds a training run: a checkpoint, or a log a training run started."""
        return os.path.exists(self.ckpt_path) or any(
            not r.get('eval_only') for r in (read_run(self.out_dir) or {}).get('start', ()))

    def logged_run_id(self):  # the id of the run that started its log, or None
        starts = (read_run(self.out_dir) or {}).get('start')
        return starts[-1].get('run_id') if starts else None

    def claim(self):
        """Make out_dir and hold it until the process exits; clear what a killed writer left."""
        if self.write:
            os.makedirs(self.out_dir, exist_ok=True)
            if not lock(self.lock_path):
                self.fail(f"--out_dir={self.out_dir} {in_use(self.lock_path, 'run')}")
            for tmp in glob.glob(os.path.join(self.out_dir, '*.tmp')):
                os.remove(tmp)

    def new_log(self):
        """Move a run already in out_dir to a folder of its own in out_dir/replaced/, so nothing
        can resume it and no earlier replaced run is lost."""
        old = [path for path in (self.ckpt_path, self.log_path) if os.path.exists(path)]
        if self.write and old:
            os.makedirs(os.path.join(self.out_dir, 'replaced'), exist_ok=True)
            moved = tempfile.mkdtemp(dir=os.path.join(self.out_dir, 'replaced'),
                                     prefix=time.strftime('%Y%m%d-%H%M%S-'))
            for path in old:
                os.replace(path, os.path.join(moved, os.path.basename(path)))
            print(f"note: moved the run that was in {self.out_dir}/ to {moved}/")

    def track(self, project, name, run_id):
        """Log each evaluation to W&B too, in a W&B run of this run's id: a resumed or requeued
        run continues it. Called before anything is written: if W&B cannot start, one line."""
        import wandb  # only when asked for, as in nanoGPT
        timeout = float(os.environ.get('WANDB_INIT_TIMEOUT', 20))  # W&B's own, 90 s, looks hung
        try:  # quiet: also no account look-ups (5 s each without a network)
            self.wandb = wandb.init(project=project, name=name, id=run_id, resume='allow',
                                    config=self.settings, settings=wandb.Settings(
                                        quiet=True, init_timeout=timeout))
        except Exception as e:  # a project name W&B refuses, no API key, no answer in time
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            self.fail(f"--wandb_log=True: W&B could not start the run ({why}); fix that, or "
                      f"set WANDB_MODE=offline to log offline (then `wandb sync`), or drop "
                      f"--wandb_log=True")

    def log(self, record):
        if self.wandb and record['event'] == 'eval':  # its layers flattened: layers/0/load_cv...
            self.wandb.log({k: v for k, v in record.items() if k != 'layers'} | {
                f'layers/{i}/{k}': v for i, layer in enumerate(record['layers'])
                for k, v in layer.items()}, step=record['iter'])
        if self.write and not self.error:
            try:
                append_line(self.log_path, json.dumps(record))
            except OSError as e:
                self.error = f"could not write {self.log_path} ({e.strerror or e})"

    def save(self, ckpt):
        if self.write and not self.error:
            try:
                save(ckpt, self.ckpt_path)
                self.saved_iter = ckpt['iter_num']
            except OSError as e:
                self.error = f"could not write {self.ckpt_path} ({e.strerror or e})"

    # how it stops

    def fail(self, message):
        """Under torchrun rank 0 alone says it. Before the ranks join (a check each makes alike)
        another rank waits first: torchrun stops every rank once one exits, and rank 0 could be
        stopped before it said why. A rank still running 5 s later failed alone, and says it."""
        if self.master or dist.is_initialized():
            fail(message, quiet=not self.master)
        time.sleep(5)
        fail(message)

    def resume_command(self, **changes):  # this command, resuming, with changed settings
        changed = tuple(f'--{key}=' for key in ('init_from', 'overwrite', *changes))
        args = [a for a in sys.argv[1:] if not a.startswith(changed)]
        args += [f'--{key}={value}' for key, value in changes.items()] + ['--init_from=resume']
        launcher = f"torchrun --standalone --nproc_per_node={self.world_size}" * self.ddp
        return f"{launcher or 'python'} {shlex.join([sys.argv[0], *args])}"

    def kept(self, fix='', **changes):
        """What a stopped run leaves, and how to go on."""
        then = f"{fix}, then " if fix else ''
        if self.saved_iter is None:
            return f"this run wrote no checkpoint; {then}start again with --overwrite=True"
        return (f"{self.ckpt_path} is left as it was (step {self.saved_iter}); {then}"
                f"continue with: {self.resume_command(**changes)}")

    def stop(self, why, fix, **changes):
        if self.ddp:
            dist.destroy_process_group()  # every rank stops at this step: rank 0 says why
        fail(f"{why}; {self.kept(fix, **changes)}", quiet=not self.master)

    def write_failed(self):  # a write the file system refused (rank 0): stop, nothing more written
        if self.error:
            self.stop(self.error, 'free some space')

    def diverged(self, step, what):
        self.log(dict(event='diverged', iter=step, what=what))
        lr, min_lr = self.settings['learning_rate'], self.settings['min_lr']
        lower = dict(learning_rate=f"{lr / 10:g}") | (  # the command goes on at a tenth
            dict(min_lr=f"{lr / 10:g}") if min_lr > lr / 10 else {})
        self.stop(f"{what} at step {step}: the run diverged and stopped",
                  f"lower --learning_rate (now {lr:g})", **lower)

    def check_weights(self, model, step):
        """Before evaluating or saving: non-finite weights are never used or saved."""
        if bad := non_finite(model.state_dict()):  # equal on every rank under DDP
            self.diverged(step, f"the weights hold NaN or inf ({bad[0]})")

    def listen(self, at_once=False):
        def request(signum, frame):  # the loop finishes its step, saves and exits
            name = signal.Signals(signum).name
            if at_once:  # an evaluation: nothing to save
                self.fail(f"{name}: stopped the evaluation before its end")
            if self.signal and time.time() > self.signal_at + 2:  # not torchrun passing it on
                self.fail(f"{name} again: stopped at once; {self.kept()}")
            if self.signal:  # the same stop passed on (torchrun; timeout signals run and group)
                return
            self.signal, self.signal_at = name, time.time()  # before print: it may be interrupted
            if self.master:
                print(f"{name}: stopping after this step (again: at once)", flush=True)
        signal.signal(signal.SIGTERM, request)
        signal.signal(signal.SIGINT, request)

    def check_step(self, step, step_loss, grad_norm, scaled):
        """Before a step is applied, every rank: a non-finite loss or gradient anywhere (scaled:
        fp16's scaler skips infs itself) or a refused write stops the run, the step unapplied;
        returns whether a signal asks to stop after it."""
        finite = torch.isfinite(step_loss) & (torch.isfinite(grad_norm) | scaled)
        flags = torch.stack([~finite, *(torch.tensor(flag, device=finite.device) for flag in (
            self.signal is not None, self.error is not None))]).float()
        if self.ddp:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        diverged, stopping, failed_write = (bool(f) for f in flags.tolist())
        if failed_write:
            self.stop(self.error, 'free some space')
        if diverged:
            self.diverged(step, f"the training loss is {float(step_loss):.4g}"
                          if not torch.isfinite(step_loss) else f"the gradient norm is "
                          f"{float(grad_norm):.4g}" if not finite else
                          "another process's loss is not finite")
        return stopping

    def after_signal(self, model, step, checkpoint):
        """Save the step just taken, say how to resume, exit cleanly."""
        self.check_weights(model, step)
        if self.master:
            self.save(checkpoint())
            self.log(dict(event='stopped', iter=step, signal=self.signal))
            self.write_failed()
            print(f"{self.signal or 'signal on another rank'}: stopped after step {step} and saved "
                  f"{self.ckpt_path}; continue with: {self.resume_command()}", flush=True)
            if self.wandb:  # W&B's run ends here too; the resumed run continues it
                self.wandb.finish()
        if self.ddp:
            dist.destroy_process_group()
        sys.exit(0)

    def on_lost_peer(self):
        """When another process of the torchrun job died (a collective fails): one line on rank
        0, what is kept and how to resume; torchrun names the process."""
        default = sys.excepthook

        def hook(kind, error, tb):
            lost = re.search('(closed|reset) by peer|Broken pipe|Timed out', str(error))
            if not (isinstance(error, dist.DistError) or isinstance(error, RuntimeError) and lost):
                return default(kind, error, tb)
            if self.master:
                why = (str(error).strip().splitlines() or [kind.__name__])[0]
                why = re.sub(r'^\[[^\]]*\]\s*', '', why).split('. ')[0]  # gloo's: no source line
                kept = self.kept("see torchrun's summary")
                print(f"error: a process of this torchrun job is gone ({why}); {kept}",
                      file=sys.stderr, flush=True)
        sys.excepthook = hook
