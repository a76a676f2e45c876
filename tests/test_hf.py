"""
hf.py, seqmoe's routers on Hugging Face MoE models: tiny OLMoE, Qwen2-MoE and Mixtral models (2
layers, 8 experts, top 2) built from a config, saved and loaded by from_pretrained (offline), each
routed as the model routes, by seqtopk, in generate, and undone.
"""
import json
import os
import runpy
import sys

import pytest
import torch
from torch.nn import functional as F

transformers = pytest.importorskip('transformers', minversion='5.0', reason="hf.py needs "
                                   "transformers 5 (pip install -r requirements.txt)")
import hf  # noqa: E402
from conftest import REPO  # noqa: E402
from router import expert_cache_rows, online_seqtopk_mask, seqtopk_mask  # noqa: E402

SHAPES = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=None)
CONFIGS = dict(olmoe=lambda: transformers.OlmoeConfig(num_experts=8, **SHAPES),
               qwen2_moe=lambda: transformers.Qwen2MoeConfig(
                   num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                   norm_topk_prob=True, **SHAPES),  # renormalised: the flag followed
               mixtral=lambda: transformers.MixtralConfig(num_local_experts=8, **SHAPES))
GREEDY = dict(max_new_tokens=6, do_sample=False)


def tiny_model(family, folder, **settings):
    """A random tiny model of the family, saved and loaded again: the real loading path."""
    torch.manual_seed(0)
    config = CONFIGS[family]()
    config.update(settings)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.fixture(scope='module', params=list(CONFIGS))
def model(request, tmp_path_factory):
    return tiny_model(request.param, tmp_path_factory.mktemp(request.param))


def left_padded(B=3, T=10, pads=(0, 3, 5), seed=1):
    """ids (B, T) of real tokens after pads[b] pad tokens, and the attention mask."""
    ids = torch.randint(3, 64, (B, T), generator=torch.Generator().manual_seed(seed))
    mask = torch.arange(T)[None] >= torch.tensor(pads)[:, None]  # (B, T)
    return ids.masked_fill(~mask, 0), mask.long()


def experts_received(model):
    """Each experts call's mask (tokens, N), rebuilt from the index and weights it was given."""
    seen = []

    def hook(experts, args):
        _, index, weights = args
        assert index.min() >= 0 and index.max() < experts.num_experts  # no skipped index
        given = torch.zeros(index.shape[0], experts.num_experts, dtype=torch.long)
        seen.append(given.scatter_add_(-1, index, (weights > 0).long()) > 0)  # 0: padding
    return seen, [b.experts.register_forward_pre_hook(hook) for b in model.seqmoe.blocks]


@torch.no_grad()
def test_topk_at_the_models_own_k_gives_its_logits_and_generate_tokens(model):
    ids, mask = left_padded()
    logits, alone = model(ids, attention_mask=mask).logits, model(ids[:1]).logits
    tokens = model.generate(ids, attention_mask=mask, **GREEDY)
    with hf.routed(model, 'topk') as routed:
        assert torch.equal(routed(ids, attention_mask=mask).logits, logits)
        assert torch.equal(routed(ids[:1]).logits, alone)  # no padding: every position
        assert torch.equal(routed.generate(ids, attention_mask=mask, **GREEDY), tokens)


@pytest.fixture(params=['eager', 'grouped_mm', 'batched_mm'])
def experts(request, model):
    """An experts implementation; the model's own (from_pretrained's) again after."""
    own = model.config._experts_implementation
    yield request.param
    model.set_experts_implementation(own)


@torch.no_grad()
def test_seqtopk_selects_what_router_seqtopk_mask_selects_in_every_experts_implementation(
        model, experts):
    """At a K not the model's (3 of 8; its own is 2) and bounds 2..5: per row, on its real
    tokens, T·K in all, 2 to 5 each; the experts get exactly that (padded slots at weight 0), and
    every implementation gives eager's logits."""
    ids, mask = left_padded()
    model.set_experts_implementation('eager')
    settings = dict(top_k=3, seq_min_k=2, seq_max_k=5, online=False)
    with hf.routed(model, 'seqtopk', **settings) as routed:
        routed.seqmoe.record = []
        eager = routed(ids, attention_mask=mask).logits
        model.set_experts_implementation(experts)
        seen, handles = experts_received(routed)
        try:
            logits = routed(ids, attention_mask=mask).logits
        finally:
            for h in handles:
                h.remove()
        record = routed.seqmoe.record[len(routed.seqmoe.blocks):]
    assert torch.allclose(logits, eager, atol=1e-5) and logits.isfinite().all()
    real = mask.bool()
    for (_, scores, selected), given in zip(record, seen, strict=True):
        assert torch.equal(given, selected.flatten(0, 1))
        assert not selected[~real].any()  # pad tokens spend no budget
        for b in range(len(ids)):
            row = selected[b, real[b]]  # (t, N)
            assert torch.equal(row, seqtopk_mask(scores[b, real[b]][None], 3, 2, 5)[0])
            assert row.sum() == 3 * len(row) and row.sum(-1).min() >= 2
            assert row.sum(-1).max() <= 5


def routing_per_layer(record, layers):
    """The recorded masks of a generation (its forwards in turn) joined along T per layer."""
    return [torch.cat([mask for layer, _, mask in record if layer == i], dim=1)
            for i in range(layers)]


@torch.no_grad()
def test_cached_generate_with_seqtopk_equals_the_causal_recomputation(model):
    """Token for token and expert for expert, with left padding: the KV cache's steps route by
    Eq. 7 against each row's Expert Cache; recomputed, the online rule over the whole prefix."""
    ids, mask = left_padded()
    with hf.routed(model, 'seqtopk') as routed:
        routed.seqmoe.record = []
        tokens = routed.generate(ids, attention_mask=mask, **GREEDY)
        cached = routing_per_layer(routed.seqmoe.record, len(routed.seqmoe.blocks))
        assert torch.equal(routed.generate(ids, attention_mask=mask, use_cache=False, **GREEDY),
                           tokens)
        routed.seqmoe.record = []
        full = torch.cat([mask, torch.ones_like(tokens[:, ids.shape[1]:-1])], dim=1)
        routed(tokens[:, :-1], attention_mask=full)  # the prefix at once, without a cache
        recomputed = routing_per_layer(routed.seqmoe.record, len(routed.seqmoe.blocks))
        real = full.bool()
        for c, r in zip(cached, recomputed, strict=True):
            assert torch.equal(c[real], r[real]) and not c[~real].any()
        _, scores, selected = routed.seqmoe.record[0]  # layer 0: the rule on its own scores
        assert torch.equal(selected[0], online_seqtopk_mask(scores[:1], 2)[0][0])


@torch.no_grad()
def test_a_prompt_routed_jointly_then_each_new_token_by_eq7_against_its_rows(model):
    """online=False in generate: the prompt by Eq. 5 per row (sample.py's 'joint'), then each
    step by Eq. 7 after its Expert Cache rows and spend (the strict budget reads the spend)."""
    ids, mask = left_padded()
    K, real = model.config.num_experts_per_tok, mask.bool()
    with hf.routed(model, 'seqtopk', online=False, seq_budget='strict') as routed:
        routed.seqmoe.record, layers = (record := []), len(routed.seqmoe.blocks)
        routed.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    for (_, prompt, joint), (_, step, taken) in zip(record[:layers], record[layers:], strict=True):
        for b in range(len(ids)):
            s = prompt[b, real[b]][None]  # (1, t, N)
            assert torch.equal(joint[b, real[b]], seqtopk_mask(s, K)[0])
            rows, spent = expert_cache_rows(s, 1, K + 2), joint[b].sum()[None]
            assert torch.equal(taken[b], online_seqtopk_mask(step[b][None], K, 1, K + 2, True,
                                                             rows, spent)[0][0])


@torch.no_grad()
def test_unrouting_restores_the_logits_bit_for_bit(model):
    ids, mask = left_padded()
    before = model(ids, attention_mask=mask).logits
    routed = hf.route(model, 'seqtopk', top_k=1, seq_max_k=8)
    assert not torch.equal(routed(ids, attention_mask=mask).logits, before)
    assert hf.unroute(routed) is model and 'generate' not in vars(model)
    assert torch.equal(model(ids, attention_mask=mask).logits, before)
    with pytest.raises(ValueError, match='beams'), hf.routed(model, 'seqtopk'):
        model.generate(ids, attention_mask=mask, num_beams=2, **GREEDY)
    assert not hasattr(model, 'seqmoe')  # the context undid it, even on an error


def test_the_adapter_takes_its_rules_from_router_py(model, monkeypatch):
    """No second top-T·K: the selection is router.py's functions' (replaced here by spies)."""
    calls = []
    for name in ('seqtopk_mask', 'online_seqtopk_mask'):
        rule = getattr(hf, name)
        monkeypatch.setattr(hf, name, lambda *a, rule=rule, **kw: calls.append(rule) or
                            rule(*a, **kw))
    ids, mask = left_padded()
    for online in (False, True):
        with torch.no_grad(), hf.routed(model, 'seqtopk', online=online):
            model(ids, attention_mask=mask)
    assert calls.count(seqtopk_mask) == calls.count(online_seqtopk_mask) == 3 * 2  # rows x layers


def test_a_model_that_is_not_a_softmax_top_k_moe_is_refused_in_one_line(tmp_path):
    config = transformers.LlamaConfig(**{k: v for k, v in SHAPES.items()
                                         if k != 'num_experts_per_tok'})
    with pytest.raises(ValueError, match='OLMoE.*Mixtral.*not llama'):
        hf.route(transformers.AutoModelForCausalLM.from_config(config))


@pytest.fixture(scope='module')
def olmoe_folder(tmp_path_factory):
    """A tiny OLMoE with a character tokenizer, and a text of its characters."""
    from tokenizers import Tokenizer, models
    folder, chars = tmp_path_factory.mktemp('olmoe'), 'abcdefghijklmnopqrstuvwxyz .,\n'
    vocab = {t: i for i, t in enumerate(['<pad>', '<s>', '<unk>', *chars])}
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab, [], unk_token='<unk>')), pad_token='<pad>',
        bos_token='<s>', unk_token='<unk>').save_pretrained(folder)
    tiny_model('olmoe', folder, initializer_range=0.5)  # far from uniform: CE reads the targets
    picks = torch.randint(len(chars), (3000,), generator=torch.Generator().manual_seed(0))
    (folder / 'text.txt').write_text(''.join(chars[i] for i in picks))
    return folder


def hf_eval(*args, monkeypatch):
    """python hf_eval.py args, in this process (transformers imported once)."""
    monkeypatch.setattr(sys, 'argv', ['hf_eval.py', *args])
    runpy.run_path(os.path.join(REPO, 'hf_eval.py'), run_name='__main__')


def test_the_script_writes_its_table_and_figure_and_samples_with_the_expert_cache(
        olmoe_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    text = olmoe_folder / 'text.txt'
    hf_eval(f'--model={olmoe_folder}', f'--text={text}', '--block_size=16', '--batch_size=2',
            '--batches=3', monkeypatch=monkeypatch)
    rows = [line.split(' | ') for line in (tmp_path / 'out-hf' / 'table.md').read_text()
            .splitlines() if line.startswith(('| 2 |', '| 1 |'))]
    assert [r[1] for r in rows] == ['topk', 'seqtopk offline', 'seqtopk causal'] * 2
    assert all(r[-1].strip(' |') == '' if r[1] == 'topk' else '[' in r[-1] for r in rows)
    for topk, *seqtopk in (rows[:3], rows[3:]):  # Δ: the mean over batches of CE - topk's CE
        for row in seqtopk:
            delta = float(row[-1].split()[0])
            assert delta == pytest.approx(float(row[3]) - float(topk[3]), abs=2e-4)
    assert abs(float(rows[2][-1].split()[0])) > 1e-3  # a difference there to see
    lm, tokenizer = hf.from_pretrained(str(olmoe_folder))
    ids = torch.tensor(tokenizer(text.read_text())['input_ids'][:3 * 2 * 17]).view(3, 2, 17)

    def ce(model):  # the mean CE of the same batches
        return torch.stack([F.cross_entropy(model(b[:, :-1]).logits.flatten(0, 1),
                                            b[:, 1:].flatten()) for b in ids]).mean().item()
    with torch.no_grad():
        assert float(rows[0][3]) == pytest.approx(ce(lm), abs=1e-4)  # topk at K: the model's
        with hf.routed(lm, 'seqtopk') as routed:  # causal: the online rule
            assert float(rows[2][3]) == pytest.approx(ce(routed), abs=1e-4)
    assert (tmp_path / 'out-hf' / 'fig1a.png').stat().st_size > 0
    drops = json.loads((tmp_path / 'out-hf' / 'fig1a.json').read_text())
    assert {len(d) for d in drops.values()} == {3 * 2 * 16}  # every token, K=2 to 1
    hf_eval(f'--model={olmoe_folder}', '--mode=sample', '--start=the', '--max_new_tokens=8',
            monkeypatch=monkeypatch)
    with torch.no_grad(), hf.routed(lm, 'seqtopk') as routed:  # the same, here
        routed.seqmoe.record = []
        routed.generate(**tokenizer('the', return_tensors='pt'), max_new_tokens=8,
                        do_sample=False)
        steps = torch.cat([m.sum(-1).flatten() for *_, m in routed.seqmoe.record[2:]]).float()
    assert steps.min() < steps.max()  # seqtopk's, not topk's 2 each
    assert (f"[seqtopk K=2 with the Expert Cache: experts per generated token and layer: mean "
            f"{steps.mean():.2f}, min {int(steps.min())}, max {int(steps.max())}]"
            in capsys.readouterr().out)
    with pytest.raises(SystemExit, match='^error: could not load'):
        hf_eval(f'--model={tmp_path}/none', monkeypatch=monkeypatch)


def test_the_script_reads_a_prepare_py_dataset_as_text(olmoe_folder, prepared, tmp_path,
                                                       monkeypatch):
    monkeypatch.chdir(prepared)  # its data/shakespeare_char, decoded, then the model's tokens
    hf_eval(f'--model={olmoe_folder}', '--mode=fig1a', '--block_size=16', '--batch_size=2',
            '--batches=2', f'--out_dir={tmp_path}', monkeypatch=monkeypatch)
    changes = json.loads((tmp_path / 'fig1a.json').read_text())
    assert list(changes) == ['topk K=1', 'seqtopk offline K=1']
    assert {len(c) for c in changes.values()} == {2 * 2 * 16}
