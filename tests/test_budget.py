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


def test_eager_decoding_keeps_the_expert_cache_the_online_rule_joined_copying_it_once(
        monkeypatch):
    from cache import Cache
    model = GPT(tiny_config('seqtopk', n_layer=2)).eval()
    cache = Cache(model.config)
    model.decode_token(torch.randint(0, 16, (2, 6)), cache)  # the prompt, token by token
    joined, cat = [], torch.cat
    monkeypatch.setattr(torch, 'cat', lambda *a, **kw: joined.append(cat(*a, **kw)) or joined[-1])
    model.decode_token(torch.randint(0, 16, (2, 1)), cache)
    kept = [layer.expert_cache for layer in cache.layers]
    copies = [t for t in joined if t.dim() == 3 and t.shape[:2] == (2, 7)]  # 6 rows + the new
    assert len(copies) == len(kept) == 2 and all(any(k is t for t in copies) for k in kept)


# -----------------------------------------------------------------------------
# the experts' matmul, chosen for the device, dtype and capability (fast.expert_matmul)

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize('device,dtype,capability,impl,want', [
    ('cuda', BF16, (9, 0), 'grouped', 'native_grouped_mm'),  # H100, H200: torch's, compiler-seen
    ('cuda', BF16, (10, 0), 'grouped', 'grouped_mm'),  # B200: pytorch#172439
    ('cuda', BF16, (8, 0), 'grouped', 'grouped_mm'),  # A100: no kernel, the op's loop
    ('cuda', FP32, (9, 0), 'grouped', 'grouped_mm'),
    ('cpu', FP32, None, 'grouped', 'grouped_mm'),  # no fp32 CPU kernel for compile's fake tensors
    ('cpu', BF16, None, 'grouped', 'grouped_mm'),
    ('cuda', BF16, (9, 0), 'loop', 'expert_loop'), ('cpu', FP32, None, 'loop', 'expert_loop')])
def test_the_experts_matmul_is_torch_s_own_only_on_capability_9_in_bf16(device, dtype, capability,
                                                                         impl, want):
    assert fast.expert_matmul(device, dtype, capability, impl) is getattr(fast, want)


@pytest.mark.parametrize('impl', ['grouped', 'loop'])
def test_the_training_step_runs_the_matmul_the_chooser_gives(impl, monkeypatch):
    asked, choose = [], fast.expert_matmul
    monkeypatch.setattr(fast, 'expert_matmul', lambda *a: asked.append(a) or choose(*a))
    model = fast.paths(GPT(tiny_config('topk', n_layer=1)), impl)
    x, y = next(counting_batches())
    model(x, y)[1].backward()
    assert asked == [('cpu', FP32, None, impl)]


def test_data_preparation_imports_no_model_and_knows_train_py_s_default_context():
    import ast
    import os

    import prepare
    from conftest import REPO
    from model import GPTConfig
    tree = ast.parse(open(os.path.join(REPO, 'prepare.py'), encoding='utf-8').read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert 'model' not in imported and prepare.TRAIN_CONTEXT == GPTConfig.block_size


def test_a_router_spending_more_than_top_k_balances_over_what_its_tokens_took():
    # windowtopk adds each token's floor to the window's T*K: the Switch loss divides by the
    # experts a token took (1 at an even load), not by top_k
    layer = router.WindowTopK(tiny_config('windowtopk', z_loss_weight=0.0, aux_loss_weight=1.0))
    logits = torch.tensor([[[5., 5, 0, 0], [0, 0, 5, 5], [0, 0, 0, 0], [0, 0, 0, 0]]])
    scores = logits.softmax(-1)  # two sure tokens, two flat ones: the window's 8 entries go to
    mask = layer.select(scores)  # tokens 1-3, token 4 takes its floor's one: 9 in all
    assert mask.sum() == 9
    want = router.switch_balance(scores, mask, 9 / 4)
    torch.testing.assert_close(layer.aux_loss(logits, scores, mask, None), want)


def test_a_router_spending_other_than_top_k_says_what_it_spends_in_the_start_line_and_params():
    from stats import start_line
    expert = 2 * 32 * 32  # config/tiny.py: n_embd 32, exp_dim 32: w_fc and w_proj of one expert
    said = {}
    for name in ('topk', 'mrltopk', 'windowtopk'):  # k=4: mrltopk draws 2 or 4, windowtopk
        model = GPT(tiny_config(name, top_k=4, n_exp=8, window_floor=1))  # adds a floor of 1
        said[name] = start_line(model, 'cpu', 'float32', 1, 1, 1).split(' experts')[0]
        n_moe, idle = len(model.routers()), model.num_params() - model.num_params(active=True)
        assert idle == round(n_moe * (8 - model.routers()[0].spend()[1]) * expert), name
    assert said == {'topk': 'topk routing, 4 of 8', 'mrltopk': 'mrltopk routing, 3 of 8',
                    'windowtopk': 'windowtopk routing, 4 to 5 of 8'}
    model = GPT(tiny_config('mrltopk', top_k=4, n_exp=8))
    assert model.num_params() - model.num_params(active=True) == len(model.routers()) * 5 * expert
