"""
nanoGPT-style settings: a script's settings are the plain values of its settings block (the lines
between the first two `# ---` lines at its top, each with its comment), overridden by preset files
and --key=value arguments, in the order given; --help lists them.

    python train.py config/tiny.py --router=seqtopk --top_k=4

Each script also states what each of its settings may be, as a dict of rules from the small
vocabulary below and a list of relations between settings; configure() checks them before anything
runs and stops at the first bad value with one line, e.g.

    error: --batch_size=0 must be a positive integer

The model's own settings are checked by model.GPTConfig.validate.
"""
import ast
import difflib
import math
import os
import re
import sys
from ast import literal_eval
from collections import namedtuple

TYPE_NAMES = {bool: 'True or False', int: 'an integer', float: 'a number', str: 'text'}


# -----------------------------------------------------------------------------
# the settings block, and --key=value

def settings_block(path, dataclass=None):
    """[(name, default, comment)] of the script at path: the assignments of its settings block;
    with a dataclass (train.py's GPTConfig), its fields too, from its class body."""
    source = open(path).read()
    lines = source.splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith('# ---')][:2]

    def entry(node, name, code):
        line = code.splitlines()[node.lineno - 1]
        comment = line.split('#', 1)[1].strip() if '#' in line[node.end_col_offset:] else ''
        return name, ast.get_source_segment(code, node.value), comment
    found = [entry(node, node.targets[0].id, source) for node in ast.parse(source).body
             if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
             and len(marks) == 2 and marks[0] < node.lineno - 1 < marks[1]]
    if dataclass is not None:
        import inspect
        code = inspect.getsource(dataclass)
        body = ast.parse(code).body[0].body
        found += [entry(node, node.target.id, code) for node in body
                  if isinstance(node, ast.AnnAssign) and node.value is not None]
    return found


def help_text(config, dataclass=None):
    """What --help prints: the script's docstring, then each setting, its default and comment."""
    rows = [f"  --{name}={default}" + (f"  # {comment}" if comment else '')
            for name, default, comment in settings_block(config['__file__'], dataclass)
            if name in config]
    return (config.get('__doc__') or '').strip() + \
        "\n\nsettings (--key=value, or a preset file of them):\n" + '\n'.join(rows)


def _parse(key, raw, default):
    if isinstance(default, float) and not isinstance(default, bool):
        try:
            return float(raw)  # also nan, inf and 1e999, so that check() can say they must be finite
        except ValueError:
            pass
    try:
        value = literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare word such as --router=seqtopk is a string
    if isinstance(default, str) and not isinstance(value, str):
        value = raw  # --top_ks=8,4,2 is the string '8,4,2', not a tuple
    if isinstance(default, bool) != isinstance(value, bool) or (
            not isinstance(default, bool) and type(value) is not type(default)):
        raise SystemExit(f"error: --{key}={raw} must be {TYPE_NAMES[type(default)]}")
    return value


def apply_overrides(config, args, known):
    """Apply preset files and --key=value pairs to the dict `config` (a script's globals()); only
    the settings in `known` may be set. Returns the keys set."""
    overridden = set()
    for arg in args:
        if not arg.startswith('--'):
            if not os.path.isfile(arg):
                raise SystemExit(f"error: preset file '{arg}' not found (settings are --key=value)")
            preset = {}
            with open(arg) as f:
                exec(f.read(), {}, preset)  # a preset is Python the user wrote, as in nanoGPT
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
            raise SystemExit(f"error: write settings as --{key}=value (--help lists them)")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise SystemExit(f"error: unknown setting --{key}" + (
                f"; did you mean --{close[0]}?" if close else "; --help lists the settings"))
        config[key] = _parse(key, raw, config[key])
        overridden.add(key)
    return overridden


def script_settings(path, args=()):
    """The settings `python path args` would run with, without running it: the script's module-level
    code before it calls configure() (its imports and settings block), then the args."""
    body = ast.parse(open(path).read(), path).body
    head = ast.Module(body[:next(i for i, node in enumerate(body)
                                 if 'configure(' in ast.unparse(node))], [])
    namespace = {'__name__': 'settings_of_' + os.path.basename(path), '__file__': path}
    exec(compile(head, path, 'exec'), namespace)
    settings = {k: v for k, v in namespace.items() if not k.startswith('_') and
                isinstance(v, (int, float, bool, str))}
    apply_overrides(namespace, list(args), set(settings))
    return {k: namespace[k] for k in sorted(settings)}


def configure(config, args, rules, relations=(), dataclass=None):
    """Every script's start: --help, or apply preset files and --key=value args to `config` (its
    globals()), then check its own settings (rules, relations); a bad one stops it with one
    `error:` line before anything runs. dataclass: one whose fields are settings too (GPTConfig).
    Returns the settings (name -> value) and the keys the args set."""
    if {'--help', '-h'} & set(args):
        print(help_text(config, dataclass))
        sys.exit(0)
    known = [name for name, _, _ in settings_block(config['__file__'], dataclass) if name in config]
    overridden = apply_overrides(config, args, set(known))
    settings = {k: config[k] for k in sorted(known)}
    try:
        check(settings, rules, relations)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
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
device_name = Rule(lambda v: re.fullmatch(r'auto|cpu|mps|cuda(:\d+)?', v) is not None,
                   'auto, cpu, cuda, cuda:N or mps')


def one_of(*choices):
    return Rule(lambda v: v in choices, 'one of ' + ', '.join(choices))


def each(rule, convert=str):
    """A comma-separated list whose every item, after convert(), follows rule."""
    return Rule(lambda v: all(rule.test(convert(item.strip())) for item in v.split(',')),
                f'a comma-separated list, each item {rule.allowed}')


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
    """ValueError naming the first setting that is not finite, breaks its rule, or breaks a
    relation (setting, test(config), what it must be: a format string over the config)."""
    def stop(key, allowed):
        value = config[key]
        shown = repr(value) if isinstance(value, str) and not value.isprintable() else value
        raise ValueError(f"--{key}={shown} must be {allowed}")
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
