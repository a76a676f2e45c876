"""
The paper's claims about the routers as tests: each router's selection, training with each of them,
relu's controller, online SeqTopK, and that a router lives in one place (router.py's table).
Run: python -m pytest -q
"""
import itertools

import numpy as np
import pytest
import torch

import fast
from conftest import counting_batches, random_scores, tiny_config, train_tiny
from model import GPT, GPTConfig
from router import (ROUTERS, Router, expert_cache_rows, mrltopk_draw, mrltopk_ks,
                    online_seqtopk_mask, online_seqtopk_token, seqtopk_mask, switch_balance,
                    step_ks, top_entries, topk_mask)
from sample import generate


# -----------------------------------------------------------------------------
# the selections

def test_topk_takes_exactly_k_experts_per_token():
    scores = random_scores(3, 17, 8)
    mask = topk_mask(scores, 3)
    assert (mask.sum(-1) == 3).all()
    # and they are the token's best: every selected score >= every unselected one
    assert (scores.masked_fill(~mask, 2).amin(-1) >= scores.masked_fill(mask, -1).amax(-1)).all()


@pytest.mark.parametrize("k,ks", [(8, [2, 4, 8]), (4, [2, 4]), (2, [2]), (1, [1]), (6, [2, 4, 6]),
                                  (12, [2, 4, 8, 12]), (64, [2, 4, 8, 16, 32, 64])])
def test_mrltopk_draws_from_the_powers_of_two_up_to_k_plus_k_itself(k, ks):
    assert mrltopk_ks(k) == ks
    draws = mrltopk_draw(k, 3000, torch.Generator().manual_seed(0))
    # plain ints: static shapes
    assert len(draws) == 3000 and all(isinstance(d, int) for d in draws)
    counts = np.array([draws.count(b) for b in ks])
    assert counts.sum() == 3000 and (abs(counts / 3000 - 1 / len(ks)) < 0.04).all()  # uniform
    # reproducible from the seed
    assert draws == mrltopk_draw(k, 3000, torch.Generator().manual_seed(0))


def test_mrltopk_routes_each_token_to_its_layers_drawn_k_in_training_and_k_at_evaluation():
    model = GPT(tiny_config('mrltopk', n_exp=8, top_k=4, n_layer=3))
    x = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    _, _, aux = model(x, moe_ks=[2, 4, 2])  # training mode: each layer its own k
    assert [mask.sum(-1).unique().tolist() for mask, _ in aux['routing']] == [[2], [4], [2]]
    for (mask, scores), k in zip(aux['routing'], (2, 4, 2)):
        assert torch.equal(mask, topk_mask(scores, k))  # the token's best k, as topk
    # its balance loss normalises by each layer's drawn k, not by top_k (a loss of another scale)
    balanced = GPT(tiny_config('mrltopk', n_exp=8, top_k=4, n_layer=3, z_loss_weight=0.0))
    _, _, drawn = balanced(x, moe_ks=[2, 4, 2])
    assert torch.allclose(drawn['aux_loss'], sum(
        balanced.config.aux_loss_weight * switch_balance(scores, mask, k)
        for (mask, scores), k in zip(drawn['routing'], (2, 4, 2))))
    _, _, aux = model(x)  # no draws given (the script draws them: step_ks): top_k
    assert all((mask.sum(-1) == 4).all() for mask, _ in aux['routing'])
    seen = set()
    for _ in range(20):  # step_ks draws each layer's k from torch's default generator
        _, _, aux = model(x, moe_ks=step_ks(model.config, 3))
        seen |= {int(mask.sum(-1).unique()) for mask, _ in aux['routing']}
    assert seen == {2, 4}
    model.eval()
    _, _, aux = model(x, moe_ks=[2, 2, 2])  # evaluation ignores draws: every token takes top_k
    assert all((mask.sum(-1) == 4).all() for mask, _ in aux['routing'])
    assert torch.equal(generate(model, x[:, :3], 8, temperature=0),
                       generate(model, x[:, :3], 8, temperature=0, use_cache=False))


@pytest.mark.parametrize("k,min_k,max_k",
                         [(2, 1, None), (3, 1, None), (2, 0, 8), (2, 2, 2), (4, 1, 8)])
def test_seqtopk_spends_exactly_T_times_k_experts_per_sequence(k, min_k, max_k):
    B, T, N = 4, 33, 8
    for ties in (False, True):
        mask = seqtopk_mask(random_scores(B, T, N, seed=k, ties=ties), k, min_k, max_k)
        assert (mask.sum(dim=(1, 2)) == T * k).all()
        per_token = mask.sum(-1)
        assert per_token.min() >= min_k
        assert per_token.max() <= (k + 2 if max_k is None else max_k)


def test_seqtopk_bounds_bind_each_token():
    # one token has all the high scores: unbounded it would take everything, bounded it gets k+2
    scores = torch.full((1, 6, 8), 0.01)
    scores[0, 0] = 0.9
    assert seqtopk_mask(scores, 2, min_k=0, max_k=8)[0, 0].sum() == 8
    assert seqtopk_mask(scores, 2, min_k=1, max_k=8)[0, 0].sum() == 7  # the other 5 keep one each
    mask = seqtopk_mask(scores, 2)
    assert mask[0, 0].sum() == 4 and (mask[0].sum(-1) >= 1).all() and mask.sum() == 12


def brute_force(scores, k, min_k, max_k):
    """Over every selection of T*k of the T x N scores with each token's count within the bounds:
    the highest total, and of the selections that reach it the per-token counts that give the
    earlier tokens the most (the tie rule: an earlier token wins)."""
    T, N = scores.shape
    best, counts_best = -1.0, None
    for chosen in itertools.combinations(range(T * N), T * k):
        counts = np.bincount(np.array(chosen) // N, minlength=T)
        if counts.min() >= min_k and counts.max() <= max_k:
            total = float(scores.flatten()[list(chosen)].sum())
            if total > best + 1e-6 or (total > best - 1e-6 and list(counts) > counts_best):
                best, counts_best = max(best, total), list(counts)
    return best, counts_best


def takes_its_best(scores, mask):
    """Each token's selected scores are its highest ones (B, T, N)."""
    count = mask.sum(-1, keepdim=True)
    ranked = scores.sort(dim=-1, descending=True).values
    return torch.allclose((scores * mask).sum(-1), (ranked * (torch.arange(
        scores.shape[-1]) < count)).sum(-1), atol=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_seqtopk_is_the_highest_total_under_the_bounds_ties_to_the_earlier_token(seed):
    T, N, k = 3, 4, 2
    for ties in (False, True):
        scores = random_scores(1, T, N, seed=seed, ties=ties)
        for min_k, max_k in [(1, 3), (0, 4), (1, 4), (2, 2), (0, 2)]:
            mask = seqtopk_mask(scores, k, min_k, max_k)
            best, counts = brute_force(scores[0], k, min_k, max_k)
            assert float(scores[mask].sum()) == pytest.approx(best, abs=1e-6)
            assert mask[0].sum(-1).tolist() == counts and takes_its_best(scores, mask)


@pytest.mark.parametrize("seed", range(4))
def test_online_seqtopk_token_m_takes_its_count_of_the_best_selection_over_tokens_1_to_m(seed):
    # Eq. 7 against brute force: token m's experts are its share of the best selection of m*k
    # entries of tokens 1..m (earlier tokens winning ties), its own best ones
    N, k = 4, 2
    for ties in (False, True):
        scores = random_scores(2, 3, N, seed=10 + seed, ties=ties)
        for min_k, max_k in [(1, 3), (0, 4), (1, 4), (2, 2)]:
            for m in (1, 2, 3):
                S = expert_cache_rows(scores[:, :m], min_k, max_k)  # tokens 1..m, token m last
                row = online_seqtopk_token(S, k, min_k)  # (B, max_k): by rank
                for b in range(2):
                    assert row[b].sum() == brute_force(scores[b, :m], k, min_k, max_k)[1][-1]
                assert torch.equal(row, torch.arange(max_k) < row.sum(-1, keepdim=True))


@pytest.mark.parametrize("strict", [False, True])
def test_the_counted_decoding_step_equals_eq_7_against_a_static_buffer_of_the_expert_cache(strict):
    # fast.online_token_counted reads a buffer of block_size rows written up to n_past (a tensor,
    # as a compiled step reads it), the rest stale (here above any score); scores of -inf (NaN
    # ones rank last) are routed as Eq. 7 does
    g = torch.Generator().manual_seed(0)
    for ties in (False, True):
        for k, min_k, max_k in [(2, 1, 4), (2, 0, 8), (3, 2, 5), (2, 2, 2)]:
            scores = random_scores(3, 12, 8, seed=k + min_k, ties=ties)
            scores[torch.rand(scores.shape, generator=g) < 0.2] = float('-inf')
            rows = expert_cache_rows(scores, min_k, max_k)
            buffer = torch.full((3, 16, max_k - min_k), 2.0)
            spent = torch.zeros(3, dtype=torch.long)
            for m in range(1, 13):
                want = online_seqtopk_mask(scores[:, m - 1:m], k, min_k, max_k, strict,
                                           rows[:, :m - 1], spent)[0][:, 0]
                got = fast.online_seqtopk_counted(scores[:, m - 1:m], k, min_k, max_k, strict,
                                                  buffer, spent, torch.tensor([m - 1]))[0][:, 0]
                assert torch.equal(got, want)
                buffer[:, m - 1] = rows[:, m - 1]
                spent += want.sum(-1)


def test_seqtopk_is_deterministic_under_ties():
    scores = torch.full((2, 16, 8), 1 / 8)  # every entry tied
    first = seqtopk_mask(scores, 2)
    assert torch.equal(first, seqtopk_mask(scores.clone(), 2))
    assert (first.sum(dim=(1, 2)) == 32).all()
    # across tokens the earlier token wins: the 16 experts beyond each token's first go 3 by 3
    # (up to max_k = 4) to the earliest tokens
    assert first[0].sum(-1).tolist() == [4] * 5 + [2] + [1] * 10


@pytest.mark.parametrize("seed", range(4))
def test_top_entries_is_the_stable_top_n_ties_to_the_earlier(seed):
    g = torch.Generator().manual_seed(seed)
    for values in (torch.randn(3, 50, generator=g),
                   torch.randint(0, 4, (3, 50), generator=g).float()):
        for n in (0, 1, 7, 25, 50):
            reference = torch.zeros_like(values, dtype=torch.bool)
            reference.scatter_(-1, values.sort(dim=-1, descending=True, stable=True).indices[:, :n],
                               True)
            assert torch.equal(top_entries(values, n), reference)


def test_seqtopk_on_a_single_token_is_topk():
    scores = random_scores(5, 1, 16, seed=3)
    for k in (1, 2, 4):
        assert torch.equal(seqtopk_mask(scores, k), topk_mask(scores, k))


@pytest.mark.parametrize("k,min_k,max_k", [(9, 1, None), (2, 3, None), (4, 1, 3), (0, 0, None)])
def test_infeasible_budgets_raise_a_clear_error(k, min_k, max_k):
    with pytest.raises(ValueError, match="top_k|bounds"):
        seqtopk_mask(random_scores(1, 4, 8), k, min_k, max_k)


def test_unknown_router_is_a_clear_error():
    with pytest.raises(ValueError, match="--router=top2 must be one of topk, mrltopk, seqtopk"):
        GPTConfig(router='top2').validate()
    with pytest.raises(ValueError, match="n_exp"):
        GPTConfig(n_exp=4, top_k=5).validate()


# -----------------------------------------------------------------------------
# online SeqTopK: each token against the tokens before it

@pytest.mark.parametrize("k,min_k,max_k",
                         [(2, 1, None), (2, 0, 8), (3, 1, 8), (2, 2, 2), (4, 1, 5)])
@pytest.mark.parametrize("ties", [False, True])
def test_online_seqtopk_routes_token_m_as_seqtopk_over_tokens_1_to_m(k, min_k, max_k, ties):
    scores = random_scores(3, 12, 8, seed=3, ties=ties)
    mask, _ = online_seqtopk_mask(scores, k, min_k, max_k)
    for m in range(1, 13):  # Eq. (7): token m's row of SeqTopK over tokens 1..m
        assert torch.equal(mask[:, m - 1], seqtopk_mask(scores[:, :m], k, min_k, max_k)[:, m - 1])
    low, high = min_k, max_k or k + 2
    assert (mask.sum(-1) >= low).all() and (mask.sum(-1) <= high).all()


@pytest.mark.parametrize("ties", [False, True])
def test_the_expert_cache_is_all_a_new_token_needs_to_be_routed_online(ties):
    # token m against the Expert Cache of tokens 1..m-1 (each token's ranks min_k..max_k-1 only)
    # takes what it would take against their whole scores: SeqTopK's last row over tokens 1..m
    for k, min_k, max_k in [(2, 1, 4), (2, 0, 8), (3, 2, 5)]:
        scores = random_scores(2, 10, 8, seed=k + min_k, ties=ties)
        for m in range(1, 11):
            cached = expert_cache_rows(scores[:, :m - 1], min_k, max_k)  # (B, m-1, R)
            assert cached.shape == (2, m - 1, max_k - min_k)
            row = online_seqtopk_mask(scores[:, m - 1:m], k, min_k, max_k, cached=cached)[0]
            assert torch.equal(row[:, 0], seqtopk_mask(scores[:, :m], k, min_k, max_k)[:, -1])
    # earlier tokens win ties: after a token of the same scores, token 2's share of the budget
    # beyond the floors (2 x (k - min_k) = 2) goes to the cached candidates, which come first
    even = torch.full((1, 2, 8), 1 / 8)
    assert online_seqtopk_token(expert_cache_rows(even, 1, 4), 2, 1).sum() == 1


@pytest.mark.parametrize("strict", [False, True])
def test_the_fast_online_seqtopk_equals_the_reference_whole_and_in_pieces(strict):
    for ties in (False, True):
        for k, min_k, max_k in [(2, 1, 4), (2, 0, 8), (3, 1, 8), (2, 2, 2)]:
            # 40 tokens: two blocks of 16 and a part
            scores = random_scores(3, 40, 8, seed=k, ties=ties)
            reference, rows = online_seqtopk_mask(scores, k, min_k, max_k, strict=strict)
            assert torch.equal(rows, expert_cache_rows(scores, min_k, max_k))  # what it keeps
            mask, counted_rows = fast.online_seqtopk_counted(scores, k, min_k, max_k, strict=strict)
            assert torch.equal(mask, reference) and torch.equal(counted_rows, rows)
            # the same routing when the sequence arrives in pieces, the earlier ones in the Expert
            # Cache
            past, spent, pieces = None, torch.zeros(3, dtype=torch.long), []
            for start, end in [(0, 5), (5, 6), (6, 13), (13, 14), (14, 37), (37, 40)]:
                piece, rows = fast.online_seqtopk_counted(scores[:, start:end], k, min_k, max_k,
                                                          strict, past, spent)
                assert torch.equal(rows, expert_cache_rows(scores[:, start:end], min_k, max_k))
                past = rows if past is None else torch.cat([past, rows], dim=1)
                spent = spent + piece.sum(dim=(1, 2))
                pieces.append(piece)
            assert torch.equal(torch.cat(pieces, dim=1), reference)


def test_online_seqtopk_routes_each_sequence_of_a_large_batch_as_it_would_alone():
    # a large batch is counted in chunks that bound memory (the blocks of a sequence, the new tokens
    # against the Expert Cache); a sequence's routing must not depend on the chunking
    scores = random_scores(64, 576, 16, seed=5, ties=True)
    rows = expert_cache_rows(scores[:, :512], 1, 6)
    mask = fast.online_seqtopk_counted(scores[:, :512], 4, 1, 6)[0]
    more = fast.online_seqtopk_counted(scores[:, 512:], 4, 1, 6, past=rows)[0]
    for b in (0, 41, 63):
        alone = fast.online_seqtopk_counted(scores[b:b + 1, :512], 4, 1, 6)[0]
        alone_more = fast.online_seqtopk_counted(scores[b:b + 1, 512:], 4, 1, 6,
                                                 past=rows[b:b + 1])[0]
        assert torch.equal(mask[b:b + 1], alone) and torch.equal(more[b:b + 1], alone_more)


def test_online_seqtopk_is_causal_and_starts_as_topk():
    scores = random_scores(2, 24, 8, seed=1)
    mask, _ = online_seqtopk_mask(scores, 2)
    # position 1 is routed as topk
    assert torch.equal(mask[:, 0], topk_mask(scores[:, :1], 2)[:, 0])
    for m in (1, 7, 15):
        changed = scores.clone()
        changed[:, m:] = random_scores(2, 24 - m, 8, seed=99 + m)
        assert torch.equal(online_seqtopk_mask(changed, 2)[0][:, :m], mask[:, :m])


def test_strict_budget_never_overspends_a_prefix_while_plain_can():
    scores = random_scores(16, 64, 8, seed=2, ties=True)
    budget = 2 * torch.arange(1, 65)
    plain = fast.online_seqtopk_counted(scores, 2, 1, 4)[0]
    strict = fast.online_seqtopk_counted(scores, 2, 1, 4, strict=True)[0]
    assert (plain.sum(-1).cumsum(-1) > budget).any()  # the paper's plain rule does overspend
    assert (strict.sum(-1).cumsum(-1) <= budget).all() and (strict.sum(-1) >= 1).all()


# -----------------------------------------------------------------------------
# the model trains with every router

@pytest.mark.parametrize("router", ROUTERS)
def test_a_tiny_model_learns_with_each_router(router):
    torch.manual_seed(0)
    model = GPT(tiny_config(router))
    losses = train_tiny(model, 30)
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


@pytest.mark.parametrize("router", ["topk", "seqtopk", "batchtopk"])
def test_every_budgeted_router_spends_exactly_B_T_k_experts_in_training(router):
    def check(routing):
        for mask, _ in routing:
            B, T, _ = mask.shape
            assert mask.sum() == B * T * 2
    train_tiny(GPT(tiny_config(router)), 5, check=check)


def test_batchtopk_takes_the_top_B_T_k_entries_of_the_batch():
    from router import batchtopk_mask
    scores = random_scores(4, 9, 8, seed=1)
    mask = batchtopk_mask(scores, 2)
    assert mask.sum() == 4 * 9 * 2
    assert scores[mask].min() >= scores[~mask].max()
    assert mask.sum(-1).max() > 2  # unlike topk, tokens compete across the whole batch


def test_windowtopk_on_one_sequence_is_seqtopk_without_bounds_plus_each_token_s_floor():
    from router import windowtopk_mask
    for floor in (1, 2):
        scores = random_scores(1, 16, 8, seed=floor)
        want = seqtopk_mask(scores, 2, min_k=0, max_k=8) | topk_mask(scores, floor)
        assert torch.equal(windowtopk_mask(scores, 2, floor), want)


def test_windowtopk_routed_online_still_gives_every_token_its_floor():
    # causal evaluation and decoding route windowtopk by Eq. 7 with its floor as the lower bound
    router = ROUTERS['windowtopk'](tiny_config('windowtopk', n_exp=8, top_k=4, window_floor=2))
    taken = router.decide(random_scores(2, 16, 8, seed=4), None, True)[0].sum(-1)  # (B, T)
    assert taken.min() >= 2 and taken.max() > 4


def test_windowtopk_ranks_windows_of_positions_across_the_batch_as_megatron_lays_them_out():
    from router import windowtopk_mask
    B, T, N, k = 4, 8, 8, 2
    scores = random_scores(B, T, N, seed=3)
    mask = windowtopk_mask(scores, k, floor=1)
    # Megatron's logits are (T, B, N); the authors' code flattens them (rows t*B + b) and views the
    # rows as B "sequences" of T: window w is positions [w*T/B, (w+1)*T/B) of every sequence
    for w in range(B):
        positions = slice(w * T // B, (w + 1) * T // B)
        window = scores[:, positions]  # (B, T/B, N)
        top = top_entries(window.transpose(0, 1).reshape(-1), T * k).view(T // B, B, N)
        assert torch.equal(mask[:, positions], top.transpose(0, 1) | topk_mask(window, 1))
        assert mask[:, positions].sum() >= T * k  # the floor only adds
    # so one sequence of high scores takes most of each window: its neighbours keep their floor
    skewed = scores.clone()
    skewed[0] *= 10
    counts = windowtopk_mask(skewed, k).sum(dim=(1, 2))
    assert counts[0] > T * k and (counts[1:] < T * k).all()
    assert (windowtopk_mask(skewed, k).sum(-1) >= 1).all()  # nobody below the floor, no cap


def test_relu_scores_make_the_gates_remoe_s_relu_of_the_logits_on_any_selection():
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0))
    for name in ('topk', 'seqtopk'):
        router = ROUTERS[name](tiny_config(name, score_func='relu'))
        mask, gates, scores, aux, _ = router(x)
        assert router.route_scale == 1  # auto: ReMoE's gates, unscaled
        torch.testing.assert_close(gates, (x @ router.gate.weight.t()).relu() * mask)
        assert torch.isfinite(aux)
    zeros = ROUTERS['topk'](tiny_config('topk', score_func='relu'))
    torch.nn.init.constant_(zeros.gate.weight, -1.0)  # every logit < 0: every score 0
    assert torch.isfinite(zeros(x.abs())[3])  # the balance loss normalises no all-zero row into NaN


def test_batchtopk_evaluation_does_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(0)
    model = GPT(tiny_config('batchtopk'))
    train_tiny(model, 10)
    thresholds = [m.ffn.router.threshold.item() for m in model.transformer.h]
    assert all(0 < t < 1 for t in thresholds)
    assert 'transformer.h.0.ffn.router.threshold' in model.state_dict()  # saved with checkpoints
    model.eval()
    x, y = next(counting_batches(seed=5, B=4))
    alone_logits, _, alone = model(x[:1], y[:1])
    batch_logits, _, batched = model(x, y)
    for (mask_alone, _), (mask_batched, _) in zip(alone['routing'], batched['routing']):
        assert torch.equal(mask_alone[0], mask_batched[0])
    torch.testing.assert_close(alone_logits[0], batch_logits[0], rtol=1e-5, atol=1e-5)


def test_batchtopk_s_first_training_step_sets_its_threshold_and_later_steps_move_it():
    router = ROUTERS['batchtopk'](tiny_config('batchtopk', n_exp=4, top_k=1))
    router.select(torch.full((2, 8, 4), 0.5))
    router.after_step([router])
    assert router.threshold.item() == 0.5  # the smallest selected score itself, not 1% of it
    router.select(torch.full((2, 8, 4), 0.7))
    router.after_step([router])
    assert router.threshold.item() == pytest.approx(0.99 * 0.5 + 0.01 * 0.7)  # an EMA step


def test_batchtopk_keeps_a_threshold_at_or_below_zero_once_a_training_step_set_it():
    # relu scores (and a balance bias on the choice) make thresholds <= 0 real ones
    router = ROUTERS['batchtopk'](tiny_config('batchtopk', score_func='relu', n_exp=4, top_k=1))
    assert router.needs_calibration()  # no training step seen yet
    scores = torch.zeros(2, 8, 4)
    scores[:, :4, 0] = 1.0  # 16 of the 16 entries taken include zeros: the smallest selected is 0
    router.select(scores)
    router.after_step([router])
    assert router.threshold.item() == 0.0 and not router.needs_calibration()
    for value in (2.0, 4.0):  # two micro-batches of one step: one EMA step, from their mean
        router.select(torch.full((2, 8, 4), value))
    router.after_step([router])
    assert router.threshold.item() == pytest.approx((1 - 0.99) * 3.0)


def test_relu_routing_moves_the_active_fraction_toward_k_over_n():
    torch.manual_seed(0)
    model = GPT(tiny_config('relu', n_exp=8, relu_l1_init=1e-4))
    routers = model.routers()
    target = 2 / 8
    fractions = []
    train_tiny(model, 60, check=lambda routing: fractions.append(
        np.mean([mask.float().mean().item() for mask, _ in routing])))
    start, end = abs(np.mean(fractions[:5]) - target), abs(np.mean(fractions[-10:]) - target)
    assert start > 0.15 and end < start / 2, (fractions[:5], fractions[-10:])
    assert routers[0].l1_coef.item() != 1e-4  # lambda adapted
    assert 'transformer.h.0.ffn.router.l1_coef' in model.state_dict()


def test_remoe_regulariser_is_the_switch_formula_on_the_relu_gates():
    # hand computation: 4 tokens, 3 experts, K=2: N * sum_e mean_t(gate_e) * tokens_e / (tokens * K)
    gates = torch.tensor([[0.5, 0.0, 0.0], [0.2, 0.4, 0.0], [0.0, 0.0, 0.0], [0.3, 0.0, 0.8]],
                         requires_grad=True)
    mask = gates > 0
    mean_gate, tokens = [0.25, 0.1, 0.2], [3, 1, 1]
    expected = 3 * sum(g * n for g, n in zip(mean_gate, tokens)) / (4 * 2)
    value = switch_balance(gates, mask, 2)
    assert value.item() == pytest.approx(expected)
    # an L1 on each gate, weighted by its expert's token count: busy experts shrink most
    value.backward()
    assert torch.allclose(gates.grad, torch.tensor([3.0, 1.0, 1.0]).expand(4, 3) * 3 / (4 * 4 * 2))


def test_relu_loss_is_lambda_times_remoe_regulariser_alone():
    # no softmax balance loss and no z-loss for relu, whatever their weights say
    model = GPT(tiny_config('relu', n_exp=8, aux_loss_weight=1.0, z_loss_weight=1.0,
                            relu_l1_init=0.5))
    x = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    _, _, aux = model(x)
    expected = sum(0.5 * switch_balance(torch.relu(b.ffn.router.gate(h)),
                                        torch.relu(b.ffn.router.gate(h)) > 0, 2)
                   for b, h in zip(model.transformer.h, layer_inputs(model, x)))
    assert aux['aux_loss'].item() == pytest.approx(expected.item(), rel=1e-5)


def layer_inputs(model, x):
    """The normalised input of every block's FFN (what its router sees)."""
    h, pos = model.transformer.wte(x), torch.arange(x.shape[1])  # RoPE: positions in attention
    inputs = []
    for block in model.transformer.h:
        h = h + block.attn(block.ln_1(h), pos=pos)
        inputs.append(block.ln_2(h))
        h = h + block.ffn(block.ln_2(h))[0]
    return inputs


@pytest.mark.parametrize("per_layer", [False, True])
def test_relu_steps_lambda_once_per_step_from_the_layer_mean_or_each_layer(per_layer):
    # per_layer=False is ReMoE's controller: one lambda for the model, from the mean over its layers
    model = GPT(tiny_config('relu', n_exp=8, n_layer=3,
                            relu_l1_per_layer=per_layer))  # target 2/8 active
    routers = model.routers()
    x = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    model.after_step()
    # nothing measured yet: lambda_0 unchanged
    assert routers[0].l1_coef.item() == pytest.approx(1e-8)
    # every logit 0: layer 0 fully open (its ReLU opens at -1), layers 1-2 shut
    for router in routers:
        torch.nn.init.zeros_(router.gate.weight)
    routers[0].threshold.fill_(-1.0)
    fractions = []  # per micro-step, per layer
    for _ in range(2):  # two micro-steps of one step
        _, _, aux = model(x)
        fractions.append([mask.float().mean().item() for mask, _ in aux['routing']])
    # the mean over layers, 1/3, is too dense
    assert np.mean(fractions, axis=0).tolist() == [1.0, 0.0, 0.0]
    model.after_step()
    expected = [1e-8 * 1.2, 1e-8 / 1.2, 1e-8 / 1.2] if per_layer else [1e-8 * 1.2] * 3
    assert [r.l1_coef.item() for r in routers] == pytest.approx(expected)
    # each layer's threshold moves by step x its own relative error (active - 1/4) / (1/4), never
    # above 0
    step = model.config.relu_threshold_step
    assert ([r.threshold.item() for r in routers]
            == pytest.approx([-1 + step * 3, -step, -step], abs=1e-6))
    assert all(r.active_count.item() == 0 for r in routers)  # measurements cleared after the step
    model.eval()
    model(x)
    model.after_step()  # evaluation measures nothing: nothing changes
    assert [r.l1_coef.item() for r in routers] == pytest.approx(expected)


@pytest.mark.parametrize("threshold_step", [0.1, 0.0])
def test_a_relu_layer_with_every_gate_shut_reopens_through_its_threshold(threshold_step):
    # ReMoE's lambda only pushes gates shut: with threshold_step=0 (ReMoE exactly) a shut layer
    # stays shut
    model = GPT(tiny_config('relu', relu_threshold_step=threshold_step))
    x = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    for router in model.routers():
        torch.nn.init.zeros_(router.gate.weight)  # every logit 0: every gate shut at threshold 0
    for _ in range(2):
        _, _, aux = model(x)
        model.after_step()
    assert all((mask.sum() > 0) == (threshold_step > 0) for mask, _ in aux['routing'])


def test_relu_with_every_gate_closed_gives_no_nan():
    model = GPT(tiny_config('relu'))
    for block in model.transformer.h:
        torch.nn.init.zeros_(block.ffn.router.gate.weight)  # every logit 0: ReLU closes every gate
    x, y = next(counting_batches())
    _, ce, aux = model(x, y)
    assert all(mask.sum() == 0 for mask, _ in aux['routing'])
    (ce + aux['aux_loss']).backward()
    assert torch.isfinite(ce) and all(torch.isfinite(p.grad).all()
                                      for p in model.parameters() if p.grad is not None)


def test_dense_layers_between_moe_layers():
    model = GPT(tiny_config('seqtopk', moe_every=2))
    _, _, aux = model(torch.zeros(1, 8, dtype=torch.long))
    assert len(aux['routing']) == 1  # 2 layers, every second one MoE
    assert [type(block.ffn).__name__ for block in model.transformer.h] == ['MLP', 'MoE']


def test_a_new_router_is_one_function_a_small_class_and_a_row_in_the_table(monkeypatch):
    # "the best expert, and the next k-1 in a fixed rotation": not useful, but nothing else is
    # needed
    def rotating_mask(scores, k):
        first = scores.argmax(-1, keepdim=True)
        chosen = (first + torch.arange(k)) % scores.shape[-1]
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
    class Rotating(Router):
        def select(self, scores):
            return rotating_mask(scores, self.current_k())
    monkeypatch.setitem(ROUTERS, 'rotating', Rotating)
    torch.manual_seed(0)
    model = GPT(tiny_config('rotating'))
    losses = train_tiny(model, 30)
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
    model.eval()
    prompt = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1))
    assert torch.equal(generate(model, prompt, 10, temperature=0),
                       generate(model, prompt, 10, temperature=0, use_cache=False))


# -----------------------------------------------------------------------------
# gates and balance

def test_the_gates_are_route_scale_times_the_selected_scores():
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(0))
    # 0: n_exp, each gate about 1 at initialisation
    for scale, want in ((3.0, 3.0), (1.0, 1.0), (0.0, 4)):
        for score_func in ('softmax', 'sigmoid'):
            router = ROUTERS['seqtopk'](tiny_config('seqtopk', route_scale=scale,
                                                    score_func=score_func))
            # as GPT initialises it: near-uniform scores
            torch.nn.init.normal_(router.gate.weight, std=0.02)
            mask, weights, scores, *_ = router(x)
            # sigmoid scores start near 1/2
            want_scale = want if scale or score_func == 'softmax' else 2
            assert router.route_scale == want_scale
            if not scale:  # auto: each selected gate starts near 1
                assert abs(weights[mask].mean().item() - 1) < 0.2
            torch.testing.assert_close(weights, want_scale * scores * mask, rtol=0, atol=0)
            expected = (x @ router.gate.weight.t()).softmax(-1) if score_func == 'softmax' else \
                (x @ router.gate.weight.t()).sigmoid()
            torch.testing.assert_close(scores, expected)


def test_seqtopk_gives_a_token_with_more_experts_more_gate_mass():
    from router import routing_weights
    scores = random_scores(4, 64, 16, seed=2)
    mask = seqtopk_mask(scores, 2)  # 1 to 4 experts per token
    count = mask.sum(-1)
    mass = routing_weights(scores, mask, scale=8.0).sum(-1)
    means = [mass[count == c].mean().item() for c in (1, 2, 3, 4)]
    assert means == sorted(means) and means[-1] > 1.5 * means[0]
    # each expert a token takes adds to its gate mass: its mass is its top-c scores'
    ranked = scores.sort(dim=-1, descending=True).values.cumsum(-1)
    torch.testing.assert_close(mass, 8.0 * ranked.gather(-1, (count - 1).unsqueeze(-1)).squeeze(-1))
    # renormalised (--norm_topk_prob), one expert or four, every token gets the same mass: no
    # extra capacity
    torch.testing.assert_close(routing_weights(scores, mask, renormalize=True).sum(-1),
                               torch.ones(4, 64))


def test_the_router_z_loss_is_the_mean_squared_log_sum_exp_of_the_logits():
    # ST-MoE's z-loss, alone with balance='none'
    router = ROUTERS['topk'](tiny_config('topk', n_exp=8, balance='none', z_loss_weight=0.5))
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    logits = x @ router.gate.weight.t()
    assert router(x)[3].item() == pytest.approx(
        0.5 * logits.logsumexp(-1).square().mean().item(), rel=1e-5)


@pytest.mark.parametrize("router_name", ["topk", "seqtopk", "batchtopk"])
def test_the_balance_bias_changes_which_experts_are_chosen_never_the_gate_values(router_name):
    torch.manual_seed(0)
    router = ROUTERS[router_name](tiny_config(router_name, balance='bias', n_exp=8)).train()
    x = torch.randn(2, 16, 32)
    mask, weights, scores, *_ = router(x)
    # larger than any softmax score gap: every token now chooses expert 5
    router.expert_bias[5] = 1.0
    biased_mask, biased_weights, biased_scores, *_ = router(x)
    assert not mask[..., 5].all() and biased_mask[..., 5].all()
    torch.testing.assert_close(biased_scores, scores)  # the scores, and so the gates, are unbiased
    torch.testing.assert_close(biased_weights, router.route_scale * scores * biased_mask)
    load = router.expert_load.clone()
    router.eval()(x)
    assert torch.equal(router.expert_load, load)  # the bias follows the training load alone


def test_balance_bias_lowers_the_load_cv_of_a_skewed_router_over_training():
    def final_load_cv(balance):
        torch.manual_seed(0)
        model = GPT(tiny_config('topk', n_exp=8, balance=balance, balance_rate=0.02,
                                aux_loss_weight=0.0, bias=True))
        # skewed: every token's router input leans toward experts 0 and 1
        for block in model.transformer.h:
            direction = torch.randn(32)
            block.ln_2.bias.data.copy_(direction)
            block.ffn.router.gate.weight.data[:2] = 3 * direction / direction.norm() ** 2
        loads = []
        train_tiny(model, 40, check=lambda routing: loads.append(
            sum(mask.sum(dim=(0, 1)) for mask, _ in routing)))
        cv = lambda load: (load.float().std(unbiased=False) / load.float().mean()).item()
        return cv(loads[0]), cv(sum(loads[-5:]))
    start, aux_free = final_load_cv('bias')
    _, unbalanced = final_load_cv('none')
    assert aux_free < start / 2 and aux_free < unbalanced / 2, (start, aux_free, unbalanced)
    assert ('transformer.h.0.ffn.router.expert_bias'
            in GPT(tiny_config('topk', balance='bias')).state_dict())


def test_each_router_keeps_only_its_own_state_and_loads_another_router_s_checkpoint():
    from checkpoint import load_weights
    buffers = {name: sorted({n.rsplit('.', 1)[1]
                             for n, _ in GPT(tiny_config(name)).named_buffers()})
               for name in ROUTERS}
    assert buffers['topk'] == buffers['seqtopk'] == buffers['mrltopk'] == []
    assert buffers['batchtopk'] == ['calibrated', 'smallest_count', 'smallest_sum', 'threshold']
    assert buffers['relu'] == ['active_count', 'active_sum', 'l1_coef', 'threshold']
    # a topk checkpoint (no router state) and one written before each router kept only its own
    # (every router every buffer): both load into any router, which starts what it lacks afresh
    topk = GPT(tiny_config('topk')).state_dict()
    older = dict(topk, **{f'transformer.h.{i}.ffn.router.{name}': torch.full(shape, 0.5)
                          for i in range(2)
                          for name, shape in (('threshold', ()), ('l1_coef', ()),
                                              ('active_sum', ()), ('active_count', ()),
                                              ('expert_bias', (4,)), ('expert_load', (4,)))})
    for name in ROUTERS:
        for state in (topk, older):
            model = GPT(tiny_config(name))
            load_weights(model, dict(model=state), 'ckpt.pt')
            assert torch.equal(model.lm_head.weight, topk['lm_head.weight'])
            if name == 'relu':
                assert (model.routers()[0].l1_coef.item()
                        == pytest.approx(0.5 if state is older else 1e-8))
