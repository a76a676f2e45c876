"""
Every command README.md and results/README.md show passes its script's own settings check as
written, without training: the script's settings block, rules and relations (train.py's model
ones too), its preset files read from where the command runs; sweep.py up to its first run
(its --train_args and each run's settings checked as train.py would), prepare.py's arguments. A
command after `cd X` runs from X; where X is a `git worktree add X COMMIT` of the same block, it
is checked against that commit's scripts (in a python of its own). Run: python -m pytest -q
"""
import ast
import contextlib
import functools
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
DOCS = ('README.md', 'results/README.md')
CHECKED = ('train.py', 'sample.py', 'bench.py', 'prepare.py', 'experiments/sweep.py')
NAMED = ('experiments/analyze.py', 'experiments/plot.py')  # argparse: their --help's names
HERE = None  # a command's checkout: this one, else a commit's


class Checked(Exception):
    """Raised where a script, its settings checked, would start its work."""


def expand_loops(text):
    """A block's `for v in a b; do BODY; done` loops as BODY once per value, $v replaced
    (innermost loops first)."""
    loop = re.compile(r'\bfor (\w+) in ([^;\n]+); do\b((?:(?!\bfor\b).)*?)\bdone\b', re.S)
    while m := loop.search(text):
        body = m.group(3).strip().rstrip(';')
        bodies = [re.sub(rf'\${m.group(1)}\b', value, body) for value in m.group(2).split()]
        text = text[:m.start()] + '\n'.join(bodies) + text[m.end():]
    return text


def commands(doc):
    """(checkout, folder, words) of each command in a doc's ```bash blocks (loops expanded,
    continued lines joined, comments cut, one command per &&, ; or |) and its inline `python
    ...` spans: the folder it runs in (a `cd`'s, until its subshell ends), in this checkout or
    the commit a `git worktree add` of the block put there."""
    text = open(os.path.join(REPO, doc), encoding='utf-8').read()
    blocks = [expand_loops(b.replace('\\\n', ' ')) for b in re.findall(r'```bash\n(.*?)```', text,
                                                                       re.S)]
    blocks += re.findall(r'`((?:python|torchrun) [^`]+)`', re.sub(r'```.*?```', '', text,
                                                                  flags=re.S))
    found = []
    for block in blocks:
        worktrees = {folder: commit if re.fullmatch(r'[0-9a-f]{7,40}', commit) else HERE
                     for folder, commit in re.findall(r'git worktree add (\S+) (\S+)', block)}
        where, outer = (HERE, ''), []
        for line in block.splitlines():
            lex = shlex.shlex(line, posix=True, punctuation_chars=True)
            lex.whitespace_split, lex.commenters, command = True, '#', []
            for word in [*lex, ';']:
                if not set(word) <= set('();<>|&'):
                    command.append(word)
                    continue
                if command[:1] == ['cd']:  # where the rest of the line (or subshell) runs
                    to = command[1]
                    where = ((worktrees[to], '') if to in worktrees else
                             (where[0], os.path.join(where[1], to)))
                elif command:
                    found.append((*where, command))
                command = []
                for char in word:  # a subshell: its cd ends with it
                    if char == '(':
                        outer.append(where)
                    elif char == ')' and outer:
                        where = outer.pop()
    return found


# -----------------------------------------------------------------------------
# a script's settings check, in this process (a command's folder its working directory)

def settings_check(path, args):
    """What `python path args` says on bad settings ('' if none): the script's code up to its
    configure() call (imports, settings block, rules), then that call; train.py's model too."""
    body = ast.parse(open(path).read(), path).body
    at = next(i for i, node in enumerate(body) if 'configure(' in ast.unparse(node))
    call = next(node for node in ast.walk(body[at]) if isinstance(node, ast.Call)
                and getattr(node.func, 'id', '') == 'configure')
    script = {'__name__': 'settings_check', '__file__': path}
    exec(compile(ast.Module(body[:at], []), path, 'exec'), script)
    sys.argv = [path, *args]
    try:
        settings = eval(compile(ast.Expression(call), path, 'eval'), script)[0]
        if 'MODEL_RELATIONS' in script:  # train.py: the model it would build, and its schedule
            config = script['GPTConfig']
            model = {k: settings[k] for k in config.__dataclass_fields__ if k in settings}
            config(**model).validate()
            script['check'](dict(settings, **model), {}, script['MODEL_RELATIONS'])
    except SystemExit as e:
        return str(e.code)
    except ValueError as e:
        return f"error: {e}"
    return ''


def until_work(path, args, work, last_check=False):
    """What `python path args` says before its work starts ('' if nothing): its main() run up to
    the function `work` names (prepare.py's writing), or through it, if it is the last check
    (sweep.py's check_runs: every run's settings; out_dir's runs: none, as for a new out_dir)."""
    script = runpy.run_path(path, run_name='settings_check')
    names = script['main'].__globals__
    checks = names[work] if last_check else None

    def stop(*args, **kwargs):
        if checks:
            with tempfile.TemporaryDirectory() as empty:  # no earlier run of the sweep's
                names['out_dir'] = empty
                checks(*args, **kwargs)
        raise Checked()
    names[work] = stop
    sys.argv = [path, *args]
    try:
        script['main']()
    except SystemExit as e:
        return str(e.code)
    except Checked:
        return ''
    return f"{path} ended without starting its work"


def flag_names(path, args):
    """The --flags of args that the script's --help does not list."""
    out = io.StringIO()
    sys.argv = [path, '--help']
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        runpy.run_path(path, run_name='__main__')
    names = set(re.findall(r'(?m)^  (?:-\w, )?--(\w+)', out.getvalue()))
    return ', '.join(f"unknown {a.split('=')[0]}" for a in args
                     if a.startswith('--') and a[2:].partition('=')[0] not in names)


def check(script, args):
    """One command's check in this process, run from its folder."""
    if script == 'experiments/sweep.py':
        return until_work(script, args, 'check_runs', last_check=True)
    if script == 'prepare.py':
        return until_work(script, args, 'prepare')
    if script in CHECKED:
        return settings_check(script, args)
    return flag_names(script, args) if script in NAMED else ''  # another file: it exists


def the_script(words):
    """(the script, its arguments) of a python or torchrun command; None for others: pip, bash,
    pytest, `python -` (a stdin script), a script beside the checkout ($S/gpu_step.py)."""
    start = next((i for i, w in enumerate(words) if w in ('python', 'torchrun')), len(words))
    at = next((i for i, w in enumerate(words) if i > start and w.endswith('.py')), None)
    if at is None or words[at].startswith('$'):
        return None
    return words[at], words[at + 1:]


def in_the_docs(here):
    """(checkout, folder, (script, args), the command's line) of the docs' python and torchrun
    commands: those run in this checkout (here), or in another commit's."""
    return [(checkout, folder, found, shlex.join(words))
            for checkout, folder, words in (c for doc in DOCS for c in commands(doc))
            if (found := the_script(words)) and (checkout is HERE) == here]


def made_before(script, args, trained, tmp_path):
    """args, an --init_from of a checkpoint that an earlier command trained (into out_dir X:
    X/ckpt.pt) named by a stand-in file; train.py's out_dirs (else 'out') added to trained."""
    if script != 'train.py':
        return args
    given = dict(a[2:].partition('=')[::2] for a in args if a.startswith('--'))
    trained.add(os.path.normpath(given.get('out_dir', 'out')))
    start = given.get('init_from', 'scratch')
    if start.endswith('ckpt.pt') and os.path.normpath(os.path.dirname(start)) in trained:
        (tmp_path / start).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / start).touch()
        return [*args, f'--init_from={tmp_path / start}']
    return args


def test_every_command_in_the_docs_passes_its_script_s_settings_check(monkeypatch, tmp_path):
    import configurator  # here, not above: as forked (checked_at)
    monkeypatch.setattr(sys, 'argv', sys.argv)  # each check sets it; restored after
    # a script's settings block read once (a sweep checks each run's: 100 reads of train.py's)
    monkeypatch.setattr(configurator, 'settings_block',
                        functools.lru_cache(configurator.settings_block))
    wrong, runs, trained = [], in_the_docs(here=True), set()
    for _, folder, (script, args), line in runs:
        monkeypatch.chdir(os.path.join(REPO, folder))
        args = made_before(script, args, trained, tmp_path)
        if not os.path.isfile(script):
            wrong.append(f"{line}: {script}: no such file")
        elif said := check(script, args):
            wrong.append(f"{line}: {said}")
    assert len(runs) >= 80  # README's and results/README's python and torchrun commands
    assert not wrong, '\n'.join(wrong)


def test_a_command_run_in_another_commit_s_worktree_passes_that_commit_s_settings_check(
        tmp_path):
    # results/README.md's before-and-after tables: `cd /tmp/before && python bench.py ...`
    runs, wrong = in_the_docs(here=False), []
    for commit in dict.fromkeys(checkout for checkout, *_ in runs):
        wrong += checked_at(commit, [(folder, *found, line) for checkout, folder, found, line
                                     in runs if checkout == commit], tmp_path / commit)
    assert len(runs) >= 10
    assert not wrong, '\n'.join(wrong)


def test_every_setting_readme_names_with_a_value_is_one_a_script_accepts(monkeypatch):
    # README's `--k_schedule=0:8/50:4/75:2`, in a sentence: some script's check passes it (each
    # of `a|b`'s; not a placeholder: `--key=value`, `--dataset=NAME`)
    monkeypatch.setattr(sys, 'argv', sys.argv)
    monkeypatch.chdir(REPO)
    text = open(os.path.join(REPO, 'README.md'), encoding='utf-8').read()
    spans = re.findall(r'`(--\w+)=([^`\s]+)`', text)
    refused = [f"{name}={value}" for name, values in spans for value in values.split('|')
               if value != 'value' and not value.isupper() and not any(
                   not check(script, [f"{name}={value}"]) for script in CHECKED)]
    assert len(spans) >= 25 and not refused, refused


def checked_at(commit, runs, tree):
    """The commands of runs [(folder, script, args, line)] checked against commit's scripts, in a
    python started in its tree (its own modules): this file run as a script."""
    from forked import python  # here, not above: this file is also that python's script
    tree.mkdir()
    files = subprocess.run(['git', '-C', REPO, 'archive', commit, '--', '*.py'],
                           capture_output=True, check=True).stdout
    subprocess.run(['tar', '-x', '-C', str(tree)], input=files, check=True)
    (tree / 'runs.json').write_text(json.dumps(runs))
    result = python(os.path.abspath(__file__), 'runs.json', cwd=tree)
    assert result.returncode == 0, result.stderr
    return [f"{line} (at {commit}): {said}" for (*_, line), said in
            zip(runs, json.loads(result.stdout)) if said]


if __name__ == '__main__':  # checked_at's python: the commands in a file, in this tree
    tree = os.getcwd()
    sys.path.insert(0, tree)
    said = []
    with contextlib.redirect_stdout(sys.stderr):  # stdout: the answers alone
        for folder, script, args, _ in json.load(open(sys.argv[1])):
            os.chdir(os.path.join(tree, folder))
            said.append(f"{script}: no such file" if not os.path.isfile(script) else
                        settings_check(script, args) if script in CHECKED else
                        f"{script}: not checked at another commit")
    print(json.dumps(said))
