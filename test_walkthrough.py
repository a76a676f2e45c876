"""
The walkthrough as a test: walkthrough.ipynb runs top to bottom (its own asserts check what it
teaches: SeqTopK spends T*K, each online decision equals SeqTopK over the prefix, the textbook loop
equals the sorted dispatch), and the committed copy reads on GitHub with every output in place.
Run: python -m pytest -q
"""
import os
import time

import nbformat
from nbclient import NotebookClient

from conftest import REPO

NOTEBOOK = os.path.join(REPO, 'walkthrough.ipynb')


def test_the_committed_walkthrough_shows_every_output_and_its_pictures():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == 'code']
    assert all(cell.execution_count for cell in code)  # executed in order, not just written
    assert sum(bool(cell.outputs) for cell in code) >= 10
    assert not any(out.output_type == 'error' for cell in code for out in cell.outputs)
    pictures = [out for cell in code for out in cell.outputs if 'image/png' in out.get('data', {})]
    assert len(pictures) >= 5  # the selections, the batch, the online rule, its spend, the coloured text


def test_the_walkthrough_runs_top_to_bottom(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv('WALKTHROUGH_OUT', str(tmp_path / 'out'))  # its two short trainings
    monkeypatch.setenv('HF_DATASETS_OFFLINE', '1')
    nb = nbformat.read(NOTEBOOK, as_version=4)
    start = time.time()
    NotebookClient(nb, timeout=900, kernel_name='python3',
                   resources={'metadata': {'path': REPO}}).execute()  # a cell that errors raises
    outputs = ''.join(out.get('text', '') for cell in nb.cells if cell.cell_type == 'code'
                      for out in cell.outputs)
    assert 'textbook loop == sorted dispatch: True  == grouped kernel: True' in outputs
    assert (tmp_path / 'out-topk' / 'ckpt.pt').exists() and (tmp_path / 'out-seqtopk' / 'ckpt.pt').exists()
    with capsys.disabled():
        print(f"\n[the walkthrough ran in {time.time() - start:.0f} s]")
