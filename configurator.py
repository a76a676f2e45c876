"""
nanoGPT-style settings: the plain values between a script's first two `# ---` lines, overridden
by preset files and --key=value arguments in order (`python train.py config/tiny.py --top_k=4`);
--help lists them. Each is checked by a rule before anything runs, a bad one stopping the script
with one line (fail). Also: what the device and dtype settings mean on this machine.
"""
import ast
import ctypes.util
import difflib
import inspect
import math
import os
import platform
import sys
from argparse import ArgumentParser, RawDescriptionHelpFormatter
from collections import namedtuple
from contextlib import suppress

import torch

TYPE_NAMES = {bool: 'True or False', int: 'an integer', float: 'a number', str: 'text'}


def fail(message, quiet=False):
    """The one way a script stops on bad input: one line on stderr, no traceback (quiet: exit 1
    without it, as torchrun's other ranks do)."""
    raise SystemExit(1 if quiet else f"error: {message}")


def arg_parser(doc):
    """argparse for the scripts that use it, doc its --help: each error one line (fail), not its
    usage block."""
    parser = ArgumentParser(description=doc, formatter_class=RawDescriptionHelpFormatter)
    parser.error = lambda message: fail(f"{message} (--help lists the options)")
    return parser


def settings_block(path, dataclass=None):
    """[(name, comment)] of the settings block of the script at path (and dataclass's)."""
    def entries(code, nodes):
        lines = code.splitlines()
        return [(node.targets[0].id if isinstance(node, ast.Assign) else node.target.id,
                 lines[node.lineno - 1][node.end_col_offset:].partition('#')[2].strip())
                for node in nodes]
    source = open(path).read()
    marks = [i + 1 for i, line in enumerate(source.splitlines()) if line.startswith('# ---')][:2]
    found = entries(source, [n for n in ast.parse(source).body if isinstance(n, ast.Assign)
                             and len(marks) == 2 and marks[0] < n.lineno < marks[1]])
    if dataclass is not None:
        code = inspect.getsource(dataclass)
        found += entries(code, [n for n in ast.parse(code).body[0].body
                                if isinstance(n, ast.AnnAssign) and n.value is not None])
    return found


def parse(key, raw, default):
    """--key=raw's value (or a preset's) as the type of the default, or one line saying why not."""
    value = raw
    if isinstance(raw, str) and not isinstance(default, str):  # --top_ks=8,4,2 stays text
        with suppress(ValueError, SyntaxError):  # nan, inf, 1e999 as floats: check() says why not
            value = float(raw) if isinstance(default, float) else ast.literal_eval(raw)
    if isinstance(default, float) and type(value) is int:
        value = float(value)
    if type(value) is not type(default):
        fail(f"--{key}={raw} must be {TYPE_NAMES[type(default)]}")
    return value


def configure(config, args, rules, relations=(), dataclass=None):
    """--help, or apply presets and --key=value args to `config` (the script's globals()) and
    check them (rules, relations). Returns the settings and the names the args set."""
    block = [entry for entry in settings_block(config['__file__'], dataclass) if entry[0] in config]
    if {'--help', '-h'} & set(args):  # each setting's default value, not the code that makes it
        print((config.get('__doc__') or '').strip() + "\n\nsettings (--key=value, or a preset "
              "file of them):\n" + '\n'.join(f"  --{name}={config[name]!r}" + f"  # {comment}" *
                                              bool(comment) for name, comment in block))
        sys.exit(0)
    known, overridden = [name for name, _ in block], set()
    for arg in args:
        if arg.startswith('--'):
            key, sep, raw = arg[2:].partition('=')
            pairs = [(key, raw)] if sep else fail(f"write settings as --{key}=value (--help "
                                                  f"lists them)")
        elif os.path.isfile(arg):  # a preset is Python the user wrote, as in nanoGPT's
            preset = {}
            try:
                exec(compile(open(arg, 'rb').read(), arg, 'exec'), {}, preset)
            except Exception as e:  # whatever the file does wrong: which file, and what
                fail(f"preset {arg} did not run as Python ({type(e).__name__}: {e}); a preset "
                     f"is lines of name = value")
            pairs = [(k, v) for k, v in preset.items()  # its helpers: _names, imports, defs
                     if not k.startswith('_') and not inspect.ismodule(v) and not callable(v)]
        else:
            fail(f"preset file '{arg}' not found (settings are --key=value)")
        for key, raw in pairs:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                fail(f"unknown setting --{key}" + (f" in {arg}" * (not arg.startswith('--'))) +
                     (f"; did you mean --{close[0]}?" if close else "; --help lists the settings"))
            config[key] = parse(key, raw, config[key])
            overridden.add(key)
    settings = {k: config[k] for k in sorted(known)}
    try:
        check(settings, rules, relations)
    except ValueError as e:
        fail(e)
    return settings, overridden


# -----------------------------------------------------------------------------
# rules: what one setting may be, as (test, what to tell the user)

Rule = namedtuple('Rule', 'test allowed')
positive_int = Rule(lambda v: v >= 1, 'a positive integer')
non_negative_int = Rule(lambda v: v >= 0, 'an integer >= 0')
positive = Rule(lambda v: v > 0, 'a positive number')
non_negative = Rule(lambda v: v >= 0, 'a number >= 0')
fraction = Rule(lambda v: 0 <= v < 1, 'in [0, 1)')
non_empty = Rule(lambda v: v != '', 'non-empty text')
a_seed = Rule(lambda v: 0 <= v < 2 ** 32, 'an integer in [0, 2**32)')  # what torch's RNGs take
device_name = Rule(lambda v: v in ('auto', 'cpu', 'mps', 'cuda') or v.startswith('cuda:')
                   and v[5:].isdigit(), 'auto, cpu, cuda, cuda:N or mps')


def one_of(*choices):
    return Rule(lambda v: v in choices, 'one of ' + ', '.join(choices))


def each(rule, convert=str):
    """A comma-separated list whose every item, after convert(), follows rule; none twice (a
    sweep would run two trainings into one folder)."""
    def test(v):
        items = [item.strip() for item in v.split(',')]
        return (all(rule.test(convert(item)) for item in items)
                and len({int(i) if convert is int else i for i in items}) == len(items))
    return Rule(test, f'a comma-separated list, each item {rule.allowed}, none twice')


def schedule(text):
    """'0:16/100:8' -> [(0, 16), (100, 8)]: from each step on, that value; None if malformed."""
    try:
        steps = [tuple(int(v) for v in item.split(':')) for item in text.split('/')]
    except ValueError:
        return None
    ok = all(len(s) == 2 for s in steps) and steps[0][0] == 0 and all(
        a[0] < b[0] for a, b in zip(steps, steps[1:]))
    return steps if ok else None


def at_step(steps, step):  # a schedule's value at a step
    return [value for start, value in steps if start <= step][-1]


def check(config, rules, relations=()):
    """ValueError naming the first setting not finite, breaking its rule or a relation (setting,
    test(config), what it must be: a format string over config)."""
    def stop(key, allowed):
        value = config[key]
        shown = repr(value) if isinstance(value, str) and not value.isprintable() else value
        raise ValueError(f"--{key}={shown} must be {allowed}")
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            stop(key, 'a finite number')
    for key, rule in rules.items():
        ok = False
        with suppress(ValueError, TypeError):  # e.g. an item of a list that is not a number
            ok = rule.test(config[key])
        if not ok:
            stop(key, rule.allowed)
    for key, test, allowed in relations:
        if not test(config):
            stop(key, allowed.format(**config))


# -----------------------------------------------------------------------------
# what the device and dtype settings mean on this machine

def pick_device(device):
    """'auto' -> 'cuda' where a GPU is visible, else 'cpu'; ValueError for one not here."""
    if device == 'auto':
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    kind = device.split(':')[0]
    if kind == 'cuda' and not torch.cuda.is_available() or \
            kind == 'mps' and not torch.backends.mps.is_available():
        raise ValueError(f"--device={device} is not available on this machine (no {kind} device is "
                         f"visible); use --device=cpu")
    return device


def auto_dtype(device_type, capability=None):
    """--dtype=auto: bf16 on GPUs that compute in it (capability 8.0+: A100, H100, RTX 30 on), fp16
    with the loss scaler on older ones (V100, T4 would emulate bf16, slowly), else float32."""
    if device_type != 'cuda':
        return 'float32'
    return 'bfloat16' if capability >= (8, 0) else 'float16'


def autocast_for(device, dtype):
    """The dtype the model runs in on device, and its autocast context (off for float32)."""
    kind = device.split(':')[0]
    if dtype == 'auto':
        capability = torch.cuda.get_device_capability(device) if kind == 'cuda' else None
        dtype = auto_dtype(kind, capability)
    return dtype, torch.autocast(kind, dtype=getattr(torch, dtype), enabled=dtype != 'float32')


def keep_freed_cpu_memory():
    """glibc's malloc keeps freed memory for reuse (as jemalloc would): else every CPU tensor of
    32 MB and up is a fresh mmap whose pages fault in one by one."""
    if platform.system() == 'Linux' and platform.libc_ver()[0] == 'glibc':
        libc = ctypes.CDLL(ctypes.util.find_library('c'))
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: allocations under 1 GB from the heap
        libc.mallopt(-1, 1 << 31)  # M_TRIM_THRESHOLD: freeing keeps up to 2 GB of it for reuse
