"""
A run's files: reading and writing ckpt.pt, appending to log.jsonl, and the out_dir that holds them.
Saves are atomic; loading (always with weights_only=True) turns any file that is not a complete
seqmoe checkpoint into one line saying what is wrong with which file: empty, truncated, not a torch
file, another project's (nanoGPT's), missing keys, weights that do not fit the model.
"""
import fcntl
import glob
import io
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from contextlib import contextmanager, suppress
from dataclasses import fields

import torch

from model import ARCHITECTURE, GPTConfig

MODEL_KEYS = [f.name for f in fields(GPTConfig)]  # the settings a checkpoint's model_args hold
# model settings added since the first checkpoints, with the values that reproduce a checkpoint written
# before them (the paper's gates: the selected softmax scores, unscaled), and the buffers added with them
LEGACY_MODEL_ARGS = dict(score_func='softmax', route_scale=1.0, balance='aux', balance_rate=1e-3,
                         rope=False)
# settings that may change on resume or fine-tuning: all but the architecture
ROUTING_KEYS = set(MODEL_KEYS) - set(ARCHITECTURE)
# a router's state buffers: each router keeps its own, so a checkpoint of another router (or one
# from before routers kept only theirs) has others; a router starts those it lacks afresh
ROUTER_STATE = tuple(f'.router.{name}' for name in (
    'threshold', 'calibrated', 'smallest_sum', 'smallest_count', 'l1_coef', 'active_sum', 'active_count', 'expert_bias',
    'expert_load'))


def code_version():
    """The commit of this code ('1a2b3c4', '+dirty' with uncommitted changes), None outside git."""
    def git(*args):
        return subprocess.run(['git', '-C', os.path.dirname(os.path.abspath(__file__)), *args],
                              capture_output=True, text=True, timeout=30)
    try:
        commit = git('rev-parse', '--short', 'HEAD')
        if commit.returncode:
            return None
        dirty = git('status', '--porcelain', '--untracked-files=no').stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip() + ('+dirty' if dirty else '')


def new_run_id():  # what names one run in its log, its checkpoint and a sweep's table
    return uuid.uuid4().hex[:12]


def non_finite(state_dict):
    """Names of the floating-point tensors in state_dict holding a NaN or an inf."""
    return [name for name, t in state_dict.items()
            if torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all()]


@contextmanager
def written(path):
    """Yields a temporary path, unique to this writer, to write path's content to; renamed to path
    when the block ends, removed if it fails: a kill or a full disk never leaves half a file, and
    two processes writing one file never write into each other's."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or '.',
                               prefix=os.path.basename(path) + '.', suffix='.tmp')
    os.close(fd)
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
    """Write to a temporary file, then rename (written): a run killed mid-save keeps its last good
    checkpoint. When the file system refuses (disk full, quota, I/O error), OSError naming path, with the
    temporary file removed and the last checkpoint as it was."""
    buffer = io.BytesIO()
    torch.save(ckpt, buffer)  # in memory first: a failed write is then an OSError that says why
    with written(path) as tmp, open(tmp, 'wb') as f:
        f.write(buffer.getbuffer())
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename: a crash cannot leave the new name on no data


def append_line(path, line):
    """Append line to a log whose last line is whole (one cut off mid-write, by a run killed while
    appending, is cut away first, with a note); when the file system refuses (OSError), the log is
    cut back to its last whole line."""
    size = os.path.getsize(path) if os.path.exists(path) else 0
    if size:
        with open(path, 'rb') as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b'\n':
                f.seek(0)
                size = f.read().rfind(b'\n') + 1
                os.truncate(path, size)
                print(f"note: {path} ended in a line cut off mid-write; cut it back to its last whole line")
    try:
        with open(path, 'a') as f:
            f.write(line + '\n')
    except OSError:
        with suppress(OSError):
            os.truncate(path, size)
        raise


def read_log(path):
    """The records of a log.jsonl, skipping lines that are not whole records (a run killed while
    appending, an editor's save), with a note on stderr saying how many."""
    records, skipped = [], 0
    with open(path, encoding='utf-8', errors='replace') as f:
        for line in filter(str.strip, f):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict):
                records.append(record)
            else:
                skipped += 1
    if skipped:
        print(f"note: {path}: skipped {skipped} line(s) that are not whole records", file=sys.stderr)
    return records


LOCK = 'run.lock'  # in out_dir: held (flock) by the run that writes there, with its pid and start
HELD = []  # the lock files this process holds, open until it exits


def lock(path, wait=False):
    """Hold the kernel's exclusive lock (flock) on the file at path until this process exits: a
    process that is gone holds nothing, so no lock is ever left behind to take over. Returns
    False when another process holds it (wait=True: waits for it instead)."""
    f = open(path, 'a+')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        f.close()
        return False
    f.truncate(0)
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
    f.flush()
    HELD.append(f)
    return True


def lock_holder(path):
    """Who holds the lock at path ('pid P on host H, since T'), or None: no one."""
    if not os.path.exists(path) or any(f.name == path for f in HELD):
        return None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or 'just started'
    return None


class RunFiles:
    """out_dir's log.jsonl and ckpt.pt as a run writes them (rank 0; write=False: nothing, as an
    evaluation of a run's checkpoint): lines appended whole, checkpoints saved atomically. The first
    write the file system refuses (disk full, quota, I/O error) is kept in `error` and nothing more
    is written: the run then stops after its step, its last good checkpoint (step `saved_iter`)
    left as it was."""

    def __init__(self, out_dir, saved_iter=None, write=True):
        self.out_dir = out_dir
        self.log_path = os.path.join(out_dir, 'log.jsonl')
        self.ckpt_path = os.path.join(out_dir, 'ckpt.pt')
        self.saved_iter = saved_iter
        self.write = write
        self.error = None

    def claim(self):
        """Make out_dir and hold it for this run until the process exits (hold: a live run's lock
        is refused in one line, a gone run's taken over); nothing when it writes nothing."""
        if self.write:
            os.makedirs(self.out_dir, exist_ok=True)
            if not lock(os.path.join(self.out_dir, LOCK)):
                raise SystemExit(f"error: --out_dir={self.out_dir} {in_use(self.out_dir)}")
            for tmp in glob.glob(os.path.join(self.out_dir, '*.tmp')):  # a killed writer's
                os.remove(tmp)

    def new_log(self):
        """Start a new log; a run already in out_dir (its ckpt.pt and log.jsonl) is moved to
        out_dir/replaced/ first, so that nothing can resume it under the new run's log."""
        old = [path for path in (self.ckpt_path, self.log_path) if os.path.exists(path)]
        if self.write and old:
            replaced = os.path.join(self.out_dir, 'replaced')
            os.makedirs(replaced, exist_ok=True)
            for path in old:
                os.replace(path, os.path.join(replaced, os.path.basename(path)))
            print(f"note: moved the run that was in {self.out_dir}/ to {replaced}/")

    def log(self, record):
        if self.write and not self.error:
            try:
                append_line(self.log_path, json.dumps(record))
            except OSError as e:
                self.failed(self.log_path, e)

    def save(self, ckpt):
        if self.write and not self.error:
            try:
                save(ckpt, self.ckpt_path)
                self.saved_iter = ckpt['iter_num']
            except OSError as e:
                self.failed(self.ckpt_path, e)

    def failed(self, path, e):
        self.error = self.error or f"could not write {path} ({e.strerror or e})"

    def kept(self, fix, resume):
        """What a stopped run leaves, and how to go on."""
        if self.saved_iter is None:
            return f"this run wrote no checkpoint; {fix}, then start again"
        return (f"{self.ckpt_path} is left as it was (step {self.saved_iter}); {fix}, then continue "
                f"with: {resume}")


def in_use(out_dir):
    return (f"is in use by a live run ({lock_holder(os.path.join(out_dir, LOCK)) or 'just ended'}); "
            f"wait for it to end or stop it, or give another --out_dir")


def out_dir_problem(path):
    """Why path cannot hold a run (None when it can), found before anything runs."""
    if os.path.isdir(path) and lock_holder(os.path.join(path, LOCK)):
        return in_use(path)
    if os.path.exists(path):
        return None if os.path.isdir(path) else "exists and is not a folder; give another --out_dir"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        return (f"cannot be created ({parent} is {'not a folder' if not os.path.isdir(parent) else 'not writable'}); "
                f"give another --out_dir")


def _fail(path, why):
    raise SystemExit(f"error: {path} {why}")


def said_once(read):
    """read(..., quiet=True) exits with status 1 and no line: under torchrun every rank reads the file,
    and rank 0 alone says what is wrong with it."""
    def checked(*args, quiet=False, **kwargs):
        try:
            return read(*args, **kwargs)
        except SystemExit as e:
            raise SystemExit(1 if quiet else e.code) from None
    return checked


@said_once
def load(path, keys=('model', 'model_args', 'meta')):
    """The checkpoint dict at path, with at least `keys`, or SystemExit with one line. Loaded on the
    CPU whatever device the run uses: the model is moved after loading its weights, the optimizer
    moves its state to its parameters' devices, and the RNG states must stay CPU tensors."""
    if os.path.getsize(path) == 0:
        _fail(path, "is empty, not a checkpoint")
    with open(path, 'rb') as f:
        zipped = f.read(4) == b'PK\x03\x04'  # what torch.save writes
    try:
        with warnings.catch_warnings():  # torch warns about odd pickles; the error below says enough
            warnings.simplefilter('ignore')
            ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # torch raises many kinds; what the user needs is which file and why
        refused = re.search(r'Unsupported global: GLOBAL (\S+)', str(e))
        if refused:
            _fail(path, f"holds Python objects ({refused.group(1)}) that safe loading (weights_only=True) "
                        f"refuses; it was not written by seqmoe's train.py")
        if zipped:
            _fail(path, "is truncated or corrupt (torch cannot read it as a checkpoint archive); "
                        "use another checkpoint or train again")
        _fail(path, "is not a torch checkpoint file; give a ckpt.pt written by train.py")
    if not isinstance(ckpt, dict):
        _fail(path, f"holds a {type(ckpt).__name__}, not a checkpoint; give a ckpt.pt written by train.py")
    model_args = ckpt.get('model_args')
    if isinstance(model_args, dict) and not {'n_exp', 'router'} <= set(model_args):
        _fail(path, "is a dense GPT checkpoint from another project (nanoGPT?): its model_args have no "
                    "n_exp or router; seqmoe loads only checkpoints written by its own train.py")
    missing = [k for k in keys if k not in ckpt]
    if missing:
        _fail(path, f"is not a complete seqmoe checkpoint: it has no {', '.join(missing)} "
                    f"(it has {', '.join(map(str, ckpt)) or 'nothing'})")
    if 'model_args' in keys and (not isinstance(model_args, dict) or set(model_args) - set(MODEL_KEYS)):
        unknown = sorted(set(model_args) - set(MODEL_KEYS)) if isinstance(model_args, dict) else ['(not a dict)']
        _fail(path, f"has model settings this version does not know: {', '.join(unknown)}")
    if isinstance(model_args, dict):
        ckpt['model_args'] = {**LEGACY_MODEL_ARGS, **model_args}
    if 'meta' in keys and not (isinstance(ckpt['meta'], dict) and {'tokenizer', 'vocab_size'} <= set(ckpt['meta'])):
        _fail(path, "has no tokenizer in its meta; give a ckpt.pt written by train.py")
    if 'model' in keys:
        if not isinstance(ckpt['model'], dict):
            _fail(path, "has no weights (its 'model' is not a state dict)")
        bad = non_finite(ckpt['model'])
        if bad:
            _fail(path, f"holds non-finite weights (NaN or inf in {bad[0]}); it cannot be used")
    return ckpt


def merged_args(saved, model_args, overridden, changeable, path):
    """The model settings of a run that continues from the checkpoint at path: the saved ones, except those
    this run's command line gives (overridden), which must equal the saved ones unless they are changeable;
    ValueError otherwise."""
    for k, value in saved.items():
        if k in overridden and k not in changeable and model_args.get(k) != value:
            raise ValueError(f"{path} was trained with {k}={value!r}, this run asks for {k}={model_args[k]!r}; "
                             f"drop --{k}, or train from scratch in another --out_dir")
    return {**model_args, **{k: value for k, value in saved.items() if k not in overridden}}


def load_to_continue(source, resume, model_args, overridden, quiet=False):
    """The checkpoint a run resumes (resume=True) or fine-tunes from, and the run's model settings
    merged with its; ValueError saying what does not fit."""
    if not os.path.isfile(source):
        raise ValueError(f"--init_from=resume but there is no checkpoint at {source}; start the run "
                         f"with --init_from=scratch, or give the --out_dir of the run to continue")
    state = ('optimizer', 'iter_num', 'best_val_loss', 'batch_gen_state', 'torch_rng_state')
    checkpoint = load(source, ('model', 'model_args', 'meta') + (state if resume else ()),
                      quiet=quiet)
    return checkpoint, merged_args(checkpoint['model_args'], model_args, overridden, ROUTING_KEYS,
                                   source)


def check_vocabulary(checkpoint, source, meta, data_dir):
    """ValueError unless the data's vocabulary is the one the checkpoint was trained on."""
    if checkpoint['model_args'].get('vocab_size') != meta['vocab_size']:
        raise ValueError(f"{source} has vocab_size={checkpoint['model_args'].get('vocab_size')}, "
                         f"but {data_dir} has {meta['vocab_size']}; use the dataset it was trained "
                         f"on (--dataset={checkpoint.get('dataset')})")
    saved = checkpoint['meta']
    if (saved.get('tokenizer'), saved.get('itos')) != (meta['tokenizer'], meta.get('itos')):
        what = (f"its tokenizer is {saved.get('tokenizer')}, the data's {meta['tokenizer']}"
                if saved.get('tokenizer') != meta['tokenizer'] else
                f"the same {meta['vocab_size']} ids stand for other characters")
        raise ValueError(f"{source} was trained on another vocabulary than {data_dir}'s ({what}); "
                         f"use the dataset it was trained on (--dataset={checkpoint.get('dataset')})")


def holds_run(out_dir):
    """Whether out_dir holds a training run: its checkpoint, or the log a training run started."""
    log = os.path.join(out_dir, 'log.jsonl')
    return os.path.exists(os.path.join(out_dir, 'ckpt.pt')) or os.path.exists(log) and any(
        r.get('event') == 'start' and not r.get('eval_only') for r in read_log(log))


def log_run_id(path):
    """The run id of the run that started the log at path (None: no log, or no start record)."""
    starts = [r for r in read_log(path) if r.get('event') == 'start'] if os.path.exists(path) else []
    return starts[-1].get('run_id') if starts else None


def restore_state(checkpoint, source, optimizer, batch_gen):
    """A resumed run's optimizer, batch stream and RNG as the checkpoint left them, or ValueError."""
    try:
        optimizer.load_state_dict(checkpoint['optimizer'])
        batch_gen.set_state(checkpoint['batch_gen_state'])
        torch.set_rng_state(checkpoint['torch_rng_state'])
    except (ValueError, RuntimeError, TypeError, KeyError) as e:
        raise ValueError(f"{source} has an optimizer or RNG state this run cannot restore ({type(e).__name__}); "
                         f"fine-tune from it instead: --init_from={source} --out_dir=ANOTHER_DIR") from None


@said_once
def load_weights(model, ckpt, path):
    """model.load_state_dict(ckpt['model']), or one line naming the keys that do not fit."""
    try:
        result = model.load_state_dict(ckpt['model'], strict=False)
    except RuntimeError as e:  # a shape mismatch
        detail = next((line.strip() for line in str(e).splitlines() if 'size mismatch' in line), str(e))
        _fail(path, f"has weights that do not fit its model_args ({detail[:200]})")
    missing = [k for k in result.missing_keys if not k.endswith(ROUTER_STATE)]
    unexpected = [k for k in result.unexpected_keys if not k.endswith(ROUTER_STATE)]
    if missing or unexpected:
        _fail(path, f"has weights that do not fit its model_args: missing "
                    f"{', '.join(missing[:3]) or 'none'}, unexpected {', '.join(unexpected[:3]) or 'none'}")
