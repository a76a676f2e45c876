"""
nanoGPT-style configuration: a script's module-level values are its config, overridden by
preset files and --key=value arguments, in the order given:

    python train.py config/tiny.py --router=seqtopk --top_k=4

apply_overrides(globals(), sys.argv[1:]) returns the set of keys that were overridden.

Each script also states, right under its settings, what each one may be: a dict of rules from the
small vocabulary below, and a list of relations between settings. validate() checks them before
anything runs and stops at the first bad value with one line, e.g.

    error: --batch_size=0 must be a positive integer
"""
import difflib
import math
import os
import re
from ast import literal_eval
from collections import namedtuple

TYPE_NAMES = {bool: 'True or False', int: 'an integer', float: 'a number', str: 'text'}


def _parse(key, raw, default):
    if isinstance(default, float) and not isinstance(default, bool):
        try:
            return float(raw)  # also nan, inf and 1e999, so that validate() can say they must be finite
        except ValueError:
            pass
    try:
        value = literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare word such as --router=seqtopk is a string
    if isinstance(default, str) and not isinstance(value, str):
        value = raw  # --top_ks=8,4,2 is the string '8,4,2', not a tuple
    if default is None:
        return value
    if isinstance(default, bool) != isinstance(value, bool) or (
            not isinstance(default, bool) and type(value) is not type(default)):
        raise SystemExit(f"error: --{key}={raw} must be {TYPE_NAMES[type(default)]}")
    return value


def apply_overrides(config, args):
    """Apply preset files and --key=value pairs to the dict `config` (a script's globals())."""
    known = {k for k, v in config.items()
             if not k.startswith('_') and isinstance(v, (int, float, bool, str, type(None)))}
    overridden = set()
    for arg in args:
        if not arg.startswith('--'):
            if not os.path.isfile(arg):
                raise SystemExit(f"error: preset file '{arg}' not found (settings are --key=value)")
            preset = {}
            with open(arg) as f:
                exec(f.read(), {}, preset)
            for key, value in preset.items():
                if key.startswith('_'):
                    continue
                if key not in known:
                    raise SystemExit(f"error: unknown setting '{key}' in {arg}")
                config[key] = _parse(key, repr(value), config[key])
                overridden.add(key)
            continue
        key, sep, raw = arg[2:].partition('=')
        if not sep:
            raise SystemExit(f"error: write settings as --{key}=value")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise SystemExit(f"error: unknown setting --{key}" + (f"; did you mean --{close[0]}?" if close else
                             "; the settings are the values at the top of the script"))
        config[key] = _parse(key, raw, config[key])
        overridden.add(key)
    return overridden


# -----------------------------------------------------------------------------
# rules: what one setting may be, as (test, what to tell the user)

Rule = namedtuple('Rule', 'test allowed')
positive_int = Rule(lambda v: v >= 1, 'a positive integer')
non_negative_int = Rule(lambda v: v >= 0, 'an integer >= 0')
positive = Rule(lambda v: v > 0, 'a positive number')
non_negative = Rule(lambda v: v >= 0, 'a number >= 0')
fraction = Rule(lambda v: 0 <= v < 1, 'in [0, 1)')
non_empty = Rule(lambda v: v != '', 'non-empty text')
device_name = Rule(lambda v: re.fullmatch(r'auto|cpu|mps|cuda(:\d+)?', v) is not None,
                   'auto, cpu, cuda, cuda:N or mps')


def above(bound):
    return Rule(lambda v: v > bound, f'greater than {bound}')


def one_of(*choices):
    return Rule(lambda v: v in choices, 'one of ' + ', '.join(choices))


def each(rule, convert=str):
    """A comma-separated list whose every item, after convert(), follows rule."""
    return Rule(lambda v: all(rule.test(convert(item.strip())) for item in v.split(',')),
                f'a comma-separated list, each item {rule.allowed}')


def validate(config, rules, relations=()):
    """Stop with one line at the first setting that is not finite, breaks its rule, or breaks a
    relation (setting, test(config), what it must be: a format string over the config)."""
    def stop(key, allowed):
        value = config[key]
        shown = repr(value) if isinstance(value, str) and not value.isprintable() else value  # stays one line
        raise SystemExit(f"error: --{key}={shown} must be {allowed}")
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            stop(key, 'a finite number')
    for key, rule in rules.items():
        try:
            ok = rule.test(config[key])
        except (ValueError, TypeError):  # e.g. an item of a list that is not a number
            ok = False
        if not ok:
            stop(key, rule.allowed)
    for key, test, allowed in relations:
        if not test(config):
            stop(key, allowed.format(**config))


def autocast_for(device, dtype):
    """The dtype the model runs in on device ('auto': bf16 on CUDA GPUs that have it, else float32) and
    its autocast context (disabled for float32; the routers stay fp32 either way), for train.py and sample.py."""
    import torch
    device_type = device.split(':')[0]
    if dtype == 'auto':
        dtype = 'bfloat16' if device_type == 'cuda' and torch.cuda.is_bf16_supported() else 'float32'
    return dtype, torch.autocast(device_type, dtype=getattr(torch, dtype), enabled=dtype != 'float32')


def keep_freed_cpu_memory():
    """Let glibc's malloc keep freed memory for reuse instead of returning it to the OS (as jemalloc
    or tcmalloc do, which PyTorch's CPU tuning guide recommends). Otherwise every large CPU tensor
    of 32 MB and up is a fresh mmap whose pages fault in one by one: the expert dispatch's gathers
    cost ~8x more. Linux with glibc only; elsewhere nothing changes."""
    import ctypes
    import ctypes.util
    import platform
    if platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
        return
    libc = ctypes.CDLL(ctypes.util.find_library('c'))
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)  # allocations under 1 GB come from the reusable heap
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 31)  # and freeing keeps up to 2 GB of it for the next ones
