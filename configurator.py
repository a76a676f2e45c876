"""
nanoGPT-style configuration: a script's module-level values are its config, overridden by
preset files and --key=value arguments, in the order given:

    python train.py config/tiny.py --router=seqtopk --top_k=4

apply_overrides(globals(), sys.argv[1:]) returns the set of keys that were overridden.
"""
import os
from ast import literal_eval


def _parse(key, raw, default):
    try:
        value = literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare word such as --router=seqtopk is a string
    if isinstance(default, str) and not isinstance(value, str):
        value = raw  # --top_ks=8,4,2 is the string '8,4,2', not a tuple
    if isinstance(default, bool) or isinstance(value, bool):
        if not isinstance(value, bool) or not isinstance(default, bool):
            raise SystemExit(f"error: --{key} takes True or False, got '{raw}'")
    elif isinstance(default, float) and isinstance(value, int):
        value = float(value)
    elif default is not None and type(value) is not type(default):
        raise SystemExit(f"error: --{key} expects a value of type {type(default).__name__}, got '{raw}'")
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
            raise SystemExit(f"error: unknown setting --{key}; the settings are the values at the top of the script")
        config[key] = _parse(key, raw, config[key])
        overridden.add(key)
    return overridden


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
