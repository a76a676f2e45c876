"""
Every command README.md and results/README.md show runs as written today: it names a script that
exists, and every --setting it gives (its preset files', its --train_args', a router's own
+settings) is one that script has now, as the script's own --help lists them.
Run: python -m pytest -q
"""
import os
import re
import runpy
import shlex
from functools import lru_cache

from conftest import REPO, run

DOCS = ('README.md', 'results/README.md')
SCRIPTS = ('train.py', 'sample.py', 'bench.py', 'prepare.py', 'experiments/sweep.py',
           'experiments/analyze.py', 'experiments/plot.py')
NESTED = {'train_args': 'train.py', 'finetune_args': 'train.py'}  # sweep.py's, passed to train.py


@lru_cache(maxsize=None)
def settings():
    """{script: the settings its --help lists}."""
    helps = {script: run(script, '--help', cwd=REPO) for script in SCRIPTS}
    return {script: set(re.findall(r'(?m)^  (?:-\w, )?--(\w+)', result.stdout + result.stderr))
            for script, result in helps.items()}


def commands(doc):
    """The words of each command in a doc's ```bash blocks (continued lines joined, comments
    cut, one command per &&, ; or |) and in its inline `python ...` spans; not those after a `cd`
    on their line, which run another checkout's scripts (a commit's, compared with this one)."""
    text = open(os.path.join(REPO, doc), encoding='utf-8').read()
    blocks = re.findall(r'```bash\n(.*?)```', text, re.S)
    lines = [line for block in blocks for line in block.replace('\\\n', ' ').splitlines()]
    lines += re.findall(r'`((?:python|torchrun) [^`]+)`', re.sub(r'```.*?```', '', text,
                                                                  flags=re.S))
    found = []
    for line in lines:
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split, lex.commenters, command = True, '#', []
        for word in [*lex, ';']:
            if set(word) <= set('();<>|&'):  # the command ends
                if command[:1] == ['cd']:
                    break
                found += [command] * bool(command)
                command = []
            else:
                command.append(word)
    return found


def problems(script, args):
    """What in `python script args` its script would not know."""
    if script not in SCRIPTS:  # another file of the repository's (e.g. one a result ran)
        return [] if os.path.isfile(os.path.join(REPO, script)) else [f"{script}: no such file"]
    found = []
    for arg in args:
        if arg.startswith('--'):
            name, _, value = arg[2:].partition('=')
            found += [f"--{name}"] * (name not in settings()[script])
            if name in NESTED:
                found += problems(NESTED[name], shlex.split(value))
            if name == 'routers':  # a router's own settings: seqtopk+balance=bias
                found += problems('train.py', [f'--{s}' for r in value.split(',')
                                               for s in r.split('+')[1:]])
        elif arg.endswith('.py'):  # a preset file
            path = os.path.join(REPO, arg)
            if not os.path.isfile(path):
                found.append(f"preset {arg} (no such file)")
                continue
            preset = {k: v for k, v in runpy.run_path(path).items()
                      if not k.startswith('_') and isinstance(v, (bool, int, float, str))}
            found += problems(script, [f'--{k}={v}' for k, v in preset.items()])
    return found


def test_every_command_in_the_docs_names_a_script_and_settings_it_has_today():
    checked, wrong = 0, []
    for words in (words for doc in DOCS for words in commands(doc)):
        start = next((i for i, w in enumerate(words) if w in ('python', 'torchrun')), len(words))
        at = next((i for i, w in enumerate(words) if i > start and w.endswith('.py')), None)
        if at is None or words[at].startswith('$'):  # pip, bash, jupyter, ruff; pytest; `python
            continue  # -` (a stdin script); a script beside the checkout ($S/gpu_step.py)
        if bad := problems(words[at], words[at + 1:]):
            wrong.append(f"{shlex.join(words)}: {', '.join(bad)}")
        checked += 1
    assert checked >= 60  # README's and results/README's python and torchrun commands
    assert not wrong, '\n'.join(wrong)
