"""
CUDA graphs only where shapes are static: which training steps run as CUDA graphs (fast.graph_step),
evaluation never (fast.compiled), what train.py runs through each, and on a GPU (skipped without
one) train.py's own runs, counting the graphs CUDA-graph trees record and replay.
Run: python -m pytest -q tests/test_graphs.py
"""
import collections
import contextlib
import json
import os
import runpy
import signal
import sys
from unittest import mock

import pytest
import torch

import fast
from conftest import REPO, TINY, needs_cuda, tiny_config
from model import GPT

# (name, router, its settings): every router, seqtopk trained offline and by its online rule
ROUTINGS = [('topk', 'topk', {}), ('seqtopk', 'seqtopk', {}),
            ('seqtopk causal', 'seqtopk', {'seq_causal': True}), ('batchtopk', 'batchtopk', {}),
            ('relu', 'relu', {}), ('mrltopk', 'mrltopk', {}), ('windowtopk', 'windowtopk', {}),
            ('dense', 'topk', {'moe_every': 0})]
# static shapes: each router's pairs known in advance in training, for a k fixed over steps
STATIC = {'topk', 'seqtopk', 'batchtopk', 'dense'}
# and captured: static, and no router state updated in the forward (batchtopk's and relu's
# counts, balance='bias''s load); relu with balance='bias' is refused
CAPTURED = {('topk', 'aux'), ('topk', 'none'), ('seqtopk', 'aux'), ('seqtopk', 'none'),
            ('dense', 'aux'), ('dense', 'bias'), ('dense', 'none')}


def cuda_graphs(module):  # whether torch.compile made the module run as CUDA graphs
    return module.get_compiler_config()['triton.cudagraphs']


@pytest.mark.parametrize('name,router,kw,balance', [
    pytest.param(*routing, balance, id=f'{routing[0]}-{balance}') for routing in ROUTINGS
    for balance in ('aux', 'bias', 'none') if (routing[0], balance) != ('relu', 'bias')])
def test_a_training_step_runs_as_cuda_graphs_only_where_shapes_are_static_and_no_router_state(
        name, router, kw, balance):
    # others: pairs counted from the data (a graph per count), mrltopk's k drawn each step (a
    # graph per draw), or buffers updated by a replay, never tested equal to eager's update
    model = GPT(tiny_config(router, balance=balance, **kw))
    assert fast.static_step(model) == (name in STATIC)
    captured = (name, balance) in CAPTURED
    assert (fast.graph_step(model, 'cuda'), fast.graph_step(model, 'cpu')) == (captured, False)
    step, evaluation = fast.compiled(model, fast.graph_step(model, 'cuda'))
    assert (cuda_graphs(step), cuda_graphs(evaluation)) == (captured, False)


# -----------------------------------------------------------------------------
# train.py, run in this process (a GPU's graphs counted as they happen)

def train_here(monkeypatch, prepared, cwd, *args):
    """`python train.py config/tiny.py args` in cwd (the built-in data linked there), run in this
    process; its log's records."""
    monkeypatch.chdir(cwd)
    os.symlink(prepared / 'data', cwd / 'data')
    monkeypatch.setattr(sys, 'argv', ['train.py', TINY, '--out_dir=run', *args])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        runpy.run_path(os.path.join(REPO, 'train.py'), run_name='__main__')
    finally:  # train.py's own: a signal stops its run
        for s, handler in handlers.items():
            signal.signal(s, handler)
    with open(cwd / 'run' / 'log.jsonl') as f:
        return [json.loads(line) for line in f]


class Compiled(torch.nn.Module):
    """torch.compile(model, mode)'s stand-in, uncompiled: notes for each call whether it would
    run as CUDA graphs and whether it trains (grad enabled) or evaluates."""
    def __init__(self, model, mode, calls):
        super().__init__()
        self.model, self.mode, self.calls = model, mode, calls

    def forward(self, *args, **kwargs):
        self.calls.append(('graphs' if self.mode == 'reduce-overhead' else 'no graphs',
                           'step' if torch.is_grad_enabled() else 'evaluation'))
        return self.model(*args, **kwargs)


@pytest.fixture
def calls(monkeypatch):
    """What train.py --compile=True calls, as on a GPU: fast.graph_step's rule for CUDA."""
    calls, rule = [], fast.graph_step
    monkeypatch.setattr(fast, 'graph_step', lambda model, device_type: rule(model, 'cuda'))
    monkeypatch.setattr(torch, 'compile', lambda model, mode=None, **kw: Compiled(model, mode,
                                                                                     calls))
    return calls


@pytest.mark.parametrize('router,captured', [('seqtopk', True), ('batchtopk', False)])
def test_train_py_steps_as_fast_graph_step_says_and_evaluates_without_cuda_graphs(
        prepared, tmp_path, monkeypatch, calls, router, captured):
    # seqtopk: evaluated offline and causally, the causal pair counts the data's
    log = train_here(monkeypatch, prepared, tmp_path, f'--router={router}', '--compile=True',
                     '--max_iters=4', '--eval_interval=2')
    assert [r['iter'] for r in log if r['event'] == 'eval'] == [0, 2, 4]
    step = 'graphs' if captured else 'no graphs'
    assert set(calls) == {(step, 'step'), ('no graphs', 'evaluation')}
    assert calls.count((step, 'step')) == 4


def test_train_py_calibrates_a_router_without_cuda_graphs(prepared, trained, tmp_path,
                                                          monkeypatch, calls):
    # batchtopk evaluating a topk checkpoint first sets its threshold on training batches, in
    # training mode: through the evaluation's module even where the step's would be graphs
    monkeypatch.setattr(fast, 'graph_step', lambda model, device_type: True)
    train_here(monkeypatch, prepared, tmp_path, '--router=batchtopk', '--eval_only=True',
               f'--init_from={trained / "run" / "ckpt.pt"}', '--compile=True')
    assert calls and set(calls) == {('no graphs', 'evaluation')}
    assert len(calls) == 3 * 2  # calibration, then train and val, 2 batches each (tiny.py)


# -----------------------------------------------------------------------------
# on a GPU: CUDA-graph trees' recordings and replays, counted

@contextlib.contextmanager
def cuda_graphs_counted():
    """(recorded or replayed, FORWARD, BACKWARD or INFERENCE (no grad: evaluation)) -> how many
    graphs CUDA-graph trees record or replay in the block; compiles start afresh."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import CUDAGraphTreeManager as Trees
    counts = collections.Counter()

    def counting(method, what):
        def counted(trees, *args):
            counts[what, trees.mode.name] += 1
            return method(trees, *args)
        return counted
    torch._dynamo.reset()
    counters.clear()
    with mock.patch.object(Trees, 'record_function', counting(Trees.record_function, 'recorded')), \
            mock.patch.object(Trees, 'execute_node', counting(Trees.execute_node, 'replayed')):
        yield counts


def assert_replayed_in_most_steps(graphs, steps):
    """The training step's graphs recorded, then each replayed in at least half of the steps
    (each is recorded once, at its second call): not only never skipped."""
    from torch._dynamo.utils import counters
    for mode in ('FORWARD', 'BACKWARD'):
        assert graphs['recorded', mode] > 0, dict(graphs)
        assert graphs['replayed', mode] >= steps // 2 * graphs['recorded', mode], dict(graphs)
    assert counters['inductor']['cudagraph_skips'] == 0


@pytest.mark.compile
@needs_cuda
@pytest.mark.parametrize('args,captured', [
    ('--router=topk', True), ('--router=seqtopk', True),
    ('--router=seqtopk --seq_causal=True', False), ('--router=batchtopk', False),
    ('--router=relu', False)])
def test_cuda_train_py_replays_the_step_s_recorded_graphs_and_evaluation_records_none(
        prepared, tmp_path, monkeypatch, args, captured):
    with cuda_graphs_counted() as graphs:
        log = train_here(monkeypatch, prepared, tmp_path, *args.split(), '--compile=True',
                         '--device=cuda', '--max_iters=12', '--eval_interval=4')
    assert [r['iter'] for r in log if r['event'] == 'eval'] == [0, 4, 8, 12]
    assert graphs['recorded', 'INFERENCE'] == graphs['replayed', 'INFERENCE'] == 0
    if captured:
        assert_replayed_in_most_steps(graphs, 12)
    else:
        assert sum(graphs.values()) == 0, dict(graphs)
