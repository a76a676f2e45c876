"""
The walkthrough as a test: walkthrough.ipynb runs top to bottom (its own asserts check what it
teaches: SeqTopK spends T*K, each online decision equals SeqTopK over the prefix, the textbook loop
equals the sorted dispatch), and what it prints and draws is what the committed copy, read on
GitHub, shows: every cell prints the same, but for the seconds things took.
Run: python -m pytest -q
"""
import os
import re
import time

import nbformat
from nbclient import NotebookClient

from conftest import REPO

NOTEBOOK = os.path.join(REPO, 'walkthrough.ipynb')


def shown(cell, out='out-walkthrough'):
    """What a code cell shows: its printed text per stream (however the kernel split it into
    outputs; durations as 'N s', the trainings' folder `out` as the default), and how many
    pictures."""
    text = {}
    for output in cell.outputs:
        if output.output_type == 'stream':
            printed = re.sub(r'\b\d+(\.\d+)? ?s\b', 'N s', output.text)
            text[output.name] = text.get(output.name, '') + printed.replace(out, 'out-walkthrough')
    pictures = sum('image/png' in out.get('data', {}) for out in cell.outputs)
    return text, pictures


def test_the_committed_walkthrough_shows_every_output_and_its_pictures():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == 'code']
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))  # in order
    assert not any(out.output_type == 'error' for cell in code for out in cell.outputs)
    assert sum(shown(cell)[1] for cell in code) >= 5  # selections, batch, online, spend, tokens
    assert 'arxiv.org/abs/2511.06494' in nb.cells[0].source  # the paper


def test_the_walkthrough_runs_top_to_bottom_and_shows_what_its_committed_copy_shows(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setenv('WALKTHROUGH_OUT', str(tmp_path / 'out'))  # its two short trainings
    monkeypatch.setenv('HF_DATASETS_OFFLINE', '1')
    committed = nbformat.read(NOTEBOOK, as_version=4)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    start = time.time()
    NotebookClient(nb, timeout=900, kernel_name='python3',
                   resources={'metadata': {'path': REPO}}).execute()  # a cell that errors raises
    for ran, before in zip(nb.cells, committed.cells):  # the trainings' losses and samples too
        if ran.cell_type == 'code':
            assert shown(ran, str(tmp_path / 'out')) == shown(before), ran.source.splitlines()[0]
    assert ((tmp_path / 'out-topk' / 'ckpt.pt').exists()
            and (tmp_path / 'out-seqtopk' / 'ckpt.pt').exists())
    with capsys.disabled():
        print(f"\n[the walkthrough ran in {time.time() - start:.0f} s]")
