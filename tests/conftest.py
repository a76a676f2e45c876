"""
What the tests share: forked.py's scripts, run as python runs them; the built-in data prepared and
a tiny run trained once per session, shared by pytest-xdist's workers; tiny.py's model and toy
language. Run: python -m pytest -q -n auto
"""
import os
import runpy
import shutil
import sys

import pytest
import torch
from filelock import FileLock

from forked import HANG, OFFLINE_ENV, REPO, python, run, sweep  # noqa: F401
from tiny import (TINY, counting_batches, random_scores, tiny_config, train_step,  # noqa: F401
                  train_tiny, trained_tiny)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# the longest first: -n auto gives each worker two tests, then one at a time (maxschedchunk 1; by
# default the first quarter of the tests went to the first worker, every long one among them):
# gpu.sh's test and the SLURM tests (one at a time) start at once, on two workers
LONGEST = ['test_the_gpu_script_runs_every_part_on_the_cpu_with_tiny_sizes',
           'test_the_walkthrough_runs_top_to_bottom_and_shows_what_its_committed_copy_shows',
           'test_a_slurm_sweep_finishes_each_run_once_whatever_the_cluster_does_to_its_jobs']


def pytest_configure(config):
    if getattr(config.option, 'maxschedchunk', 0) is None:  # pytest-xdist's, unless given
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(items):
    """The tests marked long first, LONGEST's first of all, then the last collected: a worker
    starts each while the others work through the short ones, not alone at the end."""
    long = sorted([item for item in items if item.get_closest_marker('long')][::-1],
                  key=lambda item: (LONGEST + [item.name]).index(item.name))
    items[:] = long + [item for item in items if not item.get_closest_marker('long')]


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
    """A folder made by make(path) once a session: the first pytest-xdist worker to ask makes it,
    the others wait for it and share it (they only read it)."""
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


def succeeds(script, *args, cwd):
    result = run(script, *args, cwd=cwd)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope='session')
def prepared(tmp_path_factory):
    """A folder whose data/ holds the built-in dataset (characters)."""
    return made_once(tmp_path_factory, 'prepared', lambda path: succeeds('prepare.py', cwd=path))


@pytest.fixture(scope='session')
def trained(prepared, tmp_path_factory):
    """A folder with the built-in data and one finished 10-step run in run/ (ckpt.pt at step 10)."""
    def train(path):
        shutil.copytree(prepared / 'data', path / 'data')
        succeeds('train.py', TINY, '--max_iters=10', '--out_dir=run', cwd=path)
    return made_once(tmp_path_factory, 'trained', train)


@pytest.fixture(scope='module')
def workdir(trained, tmp_path_factory):
    """A folder of the module's own with copies of trained's data/ and run/."""
    path = tmp_path_factory.mktemp('work')
    for folder in ('data', 'run'):
        shutil.copytree(trained / folder, path / folder)
    return path
