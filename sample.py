"""
Generate text from a trained checkpoint.

    python sample.py --out_dir=out --start="ROMEO:" --max_new_tokens=300
    python sample.py --start=FILE:prompt.txt
"""
import os
import sys

import torch

from configurator import apply_overrides
from model import GPT, GPTConfig
from prepare import get_codec

# -----------------------------------------------------------------------------
out_dir = 'out'            # where train.py wrote ckpt.pt
start = '\n'               # the prompt, or FILE:path to read it from a file
num_samples = 2
max_new_tokens = 300
temperature = 0.8          # 0 = greedy
sample_top_k = 200         # sample among the most likely tokens only (0 = all)
seed = 1337
device = 'auto'
# -----------------------------------------------------------------------------
apply_overrides(globals(), sys.argv[1:])


def fail(message):
    raise SystemExit(f"error: {message}")


def load_model(out_dir, device):
    """The model and tokenizer meta from out_dir/ckpt.pt (loaded with weights_only=True)."""
    ckpt_path = os.path.join(out_dir, 'ckpt.pt')
    if not os.path.exists(ckpt_path):
        fail(f"no checkpoint at {ckpt_path}; train one with `python train.py --out_dir={out_dir}`")
    checkpoint = torch.load(ckpt_path, map_location=device, weights_only=True)
    model = GPT(GPTConfig(**checkpoint['model_args']))
    model.load_state_dict(checkpoint['model'])
    return model.eval().to(device), checkpoint['meta']


if __name__ == '__main__':
    device = ('cuda' if torch.cuda.is_available() else 'cpu') if device == 'auto' else device
    torch.manual_seed(seed)
    model, meta = load_model(out_dir, device)
    encode, decode = get_codec(meta)
    if start.startswith('FILE:'):
        with open(start[5:], encoding='utf-8') as f:
            start = f.read()
    try:
        start_ids = encode(start)
    except ValueError as e:
        fail(f"{e}; change --start")
    block_size = model.config.block_size
    if not start_ids:
        fail("--start is empty; give at least one character or token")
    if len(start_ids) > block_size:
        fail(f"the prompt is {len(start_ids)} tokens, longer than the model's context of {block_size}; "
             f"shorten --start")
    x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]
    for _ in range(num_samples):
        y = model.generate(x, max_new_tokens, temperature=temperature, sample_top_k=sample_top_k or None)
        print(decode(y[0].tolist()))
        print('---------------')
