"""
nanoGPT-style configuration: a script's module-level values are its config, overridden by
preset files and --key=value arguments, in the order given:

    python train.py config/tiny.py --router=seqtopk --top_k=4

configure(globals(), sys.argv[1:], RULES, RELATIONS) applies them and checks the result.

Each script also states, right under its settings, what each one may be: a dict of rules from the
small vocabulary below, and a list of relations between settings. configure() checks them before
anything runs and stops at the first bad value with one line, e.g.

    error: --batch_size=0 must be a positive integer

The model's own settings are checked by model.GPTConfig.validate, with the same vocabulary
(MODEL_RULES, at the end).
"""
import ast
import difflib
import math
import os
import re
from ast import literal_eval
from collections import namedtuple

from router import ROUTERS

TYPE_NAMES = {bool: 'True or False', int: 'an integer', float: 'a number', str: 'text'}


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

Rule = namedtuple('Rule', 'test allowed fixed', defaults=(False,))  # fixed: by the weights, if any
positive_int = Rule(lambda v: v >= 1, 'a positive integer')
non_negative_int = Rule(lambda v: v >= 0, 'an integer >= 0')
positive = Rule(lambda v: v > 0, 'a positive number')
non_negative = Rule(lambda v: v >= 0, 'a number >= 0')
fraction = Rule(lambda v: 0 <= v < 1, 'in [0, 1)')
non_empty = Rule(lambda v: v != '', 'non-empty text')
device_name = Rule(lambda v: re.fullmatch(r'auto|cpu|mps|cuda(:\d+)?', v) is not None,
                   'auto, cpu, cuda, cuda:N or mps')


flag = Rule(lambda v: isinstance(v, bool), 'True or False')


def fixed(rule):
    """The same rule for a model setting that a trained model's weights fix (its architecture)."""
    return rule._replace(fixed=True)


def above(bound):
    return Rule(lambda v: v > bound, f'greater than {bound}')


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
    """ValueError naming the first setting that is not finite, breaks its rule, or breaks a relation
    (setting, test(config), what it must be: a format string over the config): '--key=value must be ...'."""
    def stop(key, allowed):
        value = config[key]
        shown = repr(value) if isinstance(value, str) and not value.isprintable() else value  # stays one line
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


def script_settings(path, args=()):
    """The settings `python path args` would run with, without running it: the script's module-level
    values before it calls configure() (its own code, nothing from elsewhere), then the args."""
    body = ast.parse(open(path).read(), path).body
    head = ast.Module(body[:next(i for i, node in enumerate(body)
                                 if 'configure(' in ast.unparse(node))], [])
    namespace = {'__name__': 'settings_of_' + os.path.basename(path), '__file__': path}
    exec(compile(head, path, 'exec'), namespace)
    apply_overrides(namespace, list(args))
    return {k: namespace[k] for k in sorted(namespace) if not k.startswith('_') and
            isinstance(namespace[k], (int, float, bool, str))}


def configure(config, args, rules, relations=()):
    """Every script's start: apply preset files and --key=value args to `config` (its globals()), then
    check its own settings (rules, relations); a bad one stops it with one `error:` line before anything
    runs. Returns the settings (the script's int, float, bool and str globals) and the overridden keys."""
    overridden = apply_overrides(config, args)
    settings = {k: config[k] for k in sorted(config) if not k.startswith('_') and
                isinstance(config[k], (int, float, bool, str))}
    try:
        check(settings, rules, relations)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return settings, overridden


# what each model setting may be (model.GPTConfig.validate checks them; the routers, the rest):
# adding a setting is a field of GPTConfig and a rule here
MODEL_RULES = dict(
    block_size=fixed(positive_int), vocab_size=fixed(positive_int), n_layer=fixed(positive_int),
    n_head=fixed(positive_int), n_embd=fixed(positive_int), bias=fixed(flag), rope=fixed(flag),
    n_exp=fixed(positive_int), exp_dim=fixed(positive_int), moe_every=fixed(non_negative_int),
    mlp_dim=fixed(non_negative_int), dropout=fraction,
    router=Rule(lambda v: v in ROUTERS, 'one of ' + ', '.join(ROUTERS)), top_k=positive_int,
    seq_min_k=non_negative_int, seq_max_k=non_negative_int, seq_causal=flag,
    seq_budget=one_of('plain', 'strict'), window_floor=positive_int,
    score_func=one_of('softmax', 'sigmoid', 'relu'), route_scale=non_negative,
    norm_topk_prob=flag, balance=one_of('aux', 'bias', 'none'), balance_rate=positive,
    aux_loss_weight=non_negative, z_loss_weight=non_negative, threshold_decay=fraction,
    relu_l1_init=positive, relu_l1_step=above(1), relu_l1_per_layer=flag,
    relu_threshold_step=non_negative, moe_impl=one_of('grouped', 'loop'))
ARCHITECTURE = {key for key, rule in MODEL_RULES.items() if rule.fixed}
