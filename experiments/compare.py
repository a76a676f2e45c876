"""
Finished runs compared: each run's final record, and the paired differences between runs
trained with the same seeds (the same initialisation and batches), with their Student-t intervals.
"""
import math
import os
import sys
from functools import lru_cache

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the model's files

from checkpoint import read_run


def last_done(folder, evaluation=False):
    """The final record of a finished training run (evaluation=True: of an evaluation), or None."""
    log = read_run(folder)
    done = [r for r in log['done'] if bool(r.get('eval_only')) == evaluation] if log else []
    return done[-1] if done else None


@lru_cache(maxsize=None)
def t_quantile(p, df):
    """Student's t quantile for p > 0.5 (no scipy): bisection on the CDF, its density integrated
    by Simpson's rule. t_quantile(0.975, 1) = 12.706, (0.975, 2) = 4.303, (0.975, 30) = 2.042."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x, n=2000):  # P(T <= x), x >= 0
        f = [math.exp(log_c - (df + 1) / 2 * math.log1p((x * i / n) ** 2 / df))
             for i in range(n + 1)]
        return 0.5 + x / n / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))
    lo, hi = 0.0, 100.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def paired_difference(a, b, level=0.95):
    """a, b: {seed: value}. The mean of a[seed] - b[seed] over the seeds both have, with its
    t-interval (mean +- t * sd / sqrt(n)); low and high are None with a single seed."""
    diffs = [a[s] - b[s] for s in sorted(a) if s in b and a[s] is not None and b[s] is not None]
    mean, n = (float(np.mean(diffs)) if diffs else None), len(diffs)
    if n < 2:  # no interval from a single seed
        return dict(mean=mean, low=None, high=None, n=n)
    half = t_quantile(0.5 + level / 2, n - 1) * float(np.std(diffs, ddof=1)) / math.sqrt(n)
    return dict(mean=mean, low=mean - half, high=mean + half, n=n)


def markdown(header, rows=()):
    """Print a markdown table: the header's cells, the rule under them, a line per row of cells."""
    for cells in [header, ['---'] * len(header), *rows]:
        print('| ' + ' | '.join(map(str, cells)) + ' |')


def format_difference(d):
    if d['mean'] is None:
        return ''
    if d['low'] is None:
        return f"{d['mean']:+.4f} (1 seed: no interval)"
    return f"{d['mean']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"


def mean_std(values):
    """('mean ± sample sd', or the one value; '' for none) and the mean, Nones left out."""
    values = [v for v in values if v is not None]
    if not values:
        return '', None
    text = (f"{np.mean(values):.4f} ± {np.std(values, ddof=1):.4f}" if len(values) > 1
            else f"{values[0]:.4f}")
    return text, float(np.mean(values))
