"""
Routers declare their budget (Router.budget, Router.most_k) and fast.py and sample.py read that,
never the class: a new router with a fixed budget, defined here alone, gets the static path.
Run: python -m pytest -q tests/test_budget.py
"""
import pytest
import torch

import fast
import router
import sample
from conftest import tiny_config
from model import GPT
from tiny import counting_batches


class Worst(router.Router):
    """A toy router: each token its top_k lowest-scoring experts, a budget known in advance."""

    def select(self, choice):
        return router.topk_mask(-choice, self.config.top_k)

    def budget(self):
        return self.config.top_k

    most_k = budget


@pytest.fixture
def worst(monkeypatch):  # registered in this test alone
    monkeypatch.setitem(router.ROUTERS, 'worst', Worst)
    return GPT(tiny_config('worst', balance='none'))


def test_a_new_router_with_a_fixed_budget_gets_the_static_path_and_cuda_graphs(worst):
    (layer, *_), k = worst.routers(), worst.config.top_k
    assert fast.exact_pairs(layer, 10) == 10 * k and fast.static_step(worst)
    assert fast.graph_step(worst, 'cuda') and not fast.graph_step(worst, 'cpu')
    assert sample.decode_slots(worst.eval().routers()[0]) == k


@pytest.mark.compile
def test_a_new_router_with_a_fixed_budget_trains_compiled_with_no_graph_break(worst):
    torch._dynamo.reset()
    x, y = next(counting_batches())
    want = worst(x, y)[1]
    explanation = torch._dynamo.explain(fast.paths(worst))(x, y)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch.testing.assert_close(fast.paths(worst)(x, y)[1], want)  # the same loss, fast or plain
