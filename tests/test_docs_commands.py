"""Every command and snippet in README.md and docs/*.md runs (read at test time, so a rewritten page is
covered as it stands), or says why not.

A page's code blocks -- fenced (```bash, ```python, ...) and indented four spaces -- are found; a block
whose first line is a command (python, torchrun, pip, ...) is a shell block, a ```python block a
snippet, anything else (JSON, YAML, folder trees, output) data that is not run. A block is not run
when the line before it is `<!-- doc-test: skip -- REASON -->`, or per command when a rule below
names a reason (installs, the suite itself, more than one node, a GPU). Everything else runs, the
blocks of one page in order in one sandbox folder (the working directory; `configs/` linked in), as
a user would run them:

- placeholder paths `/models/...`, `/ckpt/...`, `/data/...` live in the sandbox;
- a Hugging Face folder a command reads (`--hf-dir` of an import, `--hf-config`) that is not there yet
  is a stand-in (tests/standin.py: random weights saved by `transformers`, a local tokenizer; Llama 3
  style when the name says llama, else Qwen2), a missing `init.checkpoint` of an RL run that stand-in
  converted, a missing prompt file the shipped arithmetic word problems (GSM8K's fields);
- reductions, never new behaviour: an `rl.train` run gets `REDUCE` appended (1 step, 2 prompts x 2
  samples, 8 new tokens, 2 warm-start steps; the device stays the config's), torchrun at most 2 processes;
- what a user must supply is stood in (the checkpoint and the training prompts, at the command's or
  the config's paths); an optional file (`data.eval_file`) only when the command names it, so a config
  default pointing at a file the user need not have fails here as it would for them;
- `python -m M ...` calls `M.main([...])` in this process (the import is paid once); torchrun and
  anything else is a subprocess; a ```python snippet is exec'd.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from tests.dist import REPO

DOCS = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(REPO, "docs"))
                              if f.endswith(".md"))
COMMAND_WORDS = ("python", "python3", "torchrun", "pip", "bash", "git", "./", ".ci/", "cd ", "export ")
MARKER = re.compile(r"<!--\s*doc-test:\s*skip\s*--\s*(?P<reason>\S.*?)\s*-->")
PLACEHOLDER_ROOTS = re.compile(r"(?<![\w.~-])/(models|ckpt|data)(?=/)")
REDUCE = ["train.steps=1", "train.progress=false", "train.save_every=0",
          "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "rollout.eval_prompts=2",
          "algo.mini_batches=1", "init.sft_steps=2", "teacher.sft_steps=2"]
MAX_PROCS = 2


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the block's first code line
    kind: str  # "shell", "python" or "data"
    text: str
    skip: str | None  # the marker's reason


def _kind(lang: str, text: str) -> str:
    first = next((ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")), "")
    if lang in ("python", "py"):
        return "python"
    if first.startswith(COMMAND_WORDS) or re.match(r"[A-Z_]+=\S* ", first):
        return "shell"
    return "data"


def _flush(out: list, page: str, start: int, body: list[str], skip: str | None) -> int:
    """Append one paragraph of an indented block when it is a shell command (other indented text, such
    as an example record, is data); return the index of the next paragraph's first line."""
    if body and _kind("", "\n".join(body)) == "shell":
        out.append(Block(page, start + 1, "shell", "\n".join(body), skip))
    return start + len(body) + 1


def page_blocks(page: str) -> list[Block]:
    """The code blocks of one page, in order."""
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        lines = f.read().splitlines()
    out, i = [], 0

    def marker(k):  # the nearest non-blank line above line k
        j = k - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        m = MARKER.search(lines[j]) if j >= 0 else None
        return m.group("reason") if m else None

    while i < len(lines):
        ln = lines[i]
        if ln.lstrip().startswith("```"):
            lang, start = ln.strip()[3:].strip().lower(), i
            i += 1
            body = []
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                body.append(lines[i])
                i += 1
            text = "\n".join(body)
            out.append(Block(page, start + 2, _kind(lang, text), text, marker(start)))
        elif ln.startswith("    ") and ln.strip() and (i == 0 or not lines[i - 1].strip()):
            start, body = i, []  # one indented code block; its paragraphs are classified one by one
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                if not lines[i].strip():
                    start, body = _flush(out, page, start, body, marker(start)), []
                else:
                    body.append(lines[i][4:])
                i += 1
            _flush(out, page, start, body, marker(start))
            continue
        i += 1
    return out


def commands(text: str) -> list[list[str]]:
    """argv lists: continuation lines joined, comments dropped, `&&` chains split."""
    logical, buf = [], ""
    for ln in text.splitlines():
        if ln.rstrip().endswith("\\"):
            buf += ln.rstrip()[:-1] + " "
        else:
            logical.append(buf + ln)
            buf = ""
    out = []
    for ln in logical + ([buf] if buf else []):
        argv = shlex.split(ln, comments=True)
        while argv:
            cut = argv.index("&&") if "&&" in argv else len(argv)
            out.append(argv[:cut])
            argv = argv[cut + 1:]
    return out


def _env_and_argv(argv: list[str]) -> tuple[dict, list[str]]:
    env = {}
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        k, v = argv[0].split("=", 1)
        env[k], argv = v, argv[1:]
    return env, argv


def not_run(argv: list[str]) -> str | None:
    """Why a command is not run here, or None."""
    _, argv = _env_and_argv(argv)
    joined = " ".join(argv)
    if argv[:1] == ["pip"] or argv[1:3] == ["-m", "pip"]:
        return "installs packages; CI's own install step (.ci/run) runs it"
    if "pytest" in argv[:3]:
        return "the test suite itself"
    if ".ci/run" in joined:
        return "the CI script itself"
    nodes = next((argv[k + 1] for k, a in enumerate(argv[:-1]) if a in ("--nnodes", "--nnodes=")), None)
    if nodes is not None and nodes not in ("1", "1:1"):
        return f"multi-node torchrun: needs {nodes} machines"
    if "--device cuda" in joined or "gpu_check" in joined:
        return "needs a GPU"
    return None


def runner(argv: list[str]) -> str | None:
    """How a runnable command runs ('module', 'torchrun'), or None when this test cannot run it."""
    _, argv = _env_and_argv(argv)
    if argv[:1] in (["python"], ["python3"]) and argv[1:2] == ["-m"] and len(argv) > 2:
        return "torchrun" if argv[2] == "torch.distributed.run" else "module"
    if argv[:1] == ["torchrun"]:
        return "torchrun"
    return None


def test_every_block_runs_or_says_why():
    """Fast: each shell command is runnable here or has a reason; each snippet compiles."""
    found = {"run": 0, "skipped": 0}
    for page in DOCS:
        for b in page_blocks(page):
            if b.kind == "python":
                compile(b.text, f"{b.page}:{b.line}", "exec")
            if b.kind == "data":
                continue
            if b.skip is not None:
                found["skipped"] += 1
                continue
            for argv in (commands(b.text) if b.kind == "shell" else []):
                if not_run(argv) is None:
                    assert runner(argv) is not None, (f"{b.page}:{b.line}: this test cannot run {shlex.join(argv)!r}; "
                                                      "write it as python -m / torchrun, or mark the block "
                                                      "<!-- doc-test: skip -- REASON -->")
            found["run"] += 1
    assert found["run"] >= 3  # README's quick start and docs/real_checkpoints.md at least


class Sandbox:
    def __init__(self, root: str, monkeypatch):
        self.root, self.mp = root, monkeypatch
        os.symlink(os.path.join(REPO, "configs"), os.path.join(root, "configs"))
        monkeypatch.chdir(root)

    def path(self, p: str) -> str:
        return p if os.path.isabs(p) else os.path.join(self.root, p)

    def remap(self, text: str) -> str:
        return PLACEHOLDER_ROOTS.sub(lambda m: f"{self.root}/{m.group(1)}", text)

    def hf_folder(self, p: str) -> None:
        from tests.chat_templates import LLAMA31_TOOLS, QWEN25_TOOLS
        from tests.standin import hf_standin

        p = self.path(p)
        if not os.path.isfile(os.path.join(p, "config.json")):
            llama = "llama" in p.lower()  # the published chat templates read tools; the stand-ins' do too
            hf_standin(p, "llama3" if llama else "qwen2", max_positions=2048,
                       chat_template=LLAMA31_TOOLS if llama else QWEN25_TOOLS)

    def checkpoint(self, p: str) -> None:
        from tools.convert_hf import main as convert

        p = self.path(p)
        if not os.path.exists(os.path.join(p, "manifest.json")):
            hf = os.path.join(self.root, ".standins", os.path.basename(p.rstrip("/")))
            self.hf_folder(hf)
            assert convert(["import", "--hf-dir", hf, "--out", p]) == 0

    def prompts(self, p: str) -> None:
        p = self.path(p)
        if not os.path.exists(p):
            os.makedirs(os.path.dirname(p), exist_ok=True)
            name = "arith_word_test.jsonl" if "test" in os.path.basename(p) else "arith_word_train.jsonl"
            shutil.copy(os.path.join(REPO, "core", "data", name), p)

    def provide(self, module: str, args: list[str]) -> list[str]:
        """Stand-ins for what the command reads; the args with reductions appended."""
        if module == "tools.convert_hf" and args[:1] == ["import"]:
            self.hf_folder(args[args.index("--hf-dir") + 1])
        if "--hf-config" in args:
            self.hf_folder(os.path.dirname(self.path(args[args.index("--hf-config") + 1])))
        if module != "rl.train":
            return args
        from core.config import load_config
        from rl.config import RLConfig

        config = args[args.index("--config") + 1]
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        cfg = load_config(RLConfig, self.path(config), overrides)
        extra = []
        named = {a.split("=", 1)[0] for a in overrides}
        for key, value in (("init.checkpoint", cfg.init.checkpoint),
                           ("data.train_file", cfg.data.train_file if cfg.data else None),
                           ("data.eval_file", cfg.data.eval_file if cfg.data else None)):
            if value is None:
                continue
            local = self.remap(value)
            if local != value:
                extra.append(f"{key}={local}")  # a placeholder path of the config, in the sandbox
            # what a user must supply is stood in; an optional file the command does not name is not
            if "--dry-run" not in args and (key != "data.eval_file" or key in named):
                (self.checkpoint if key == "init.checkpoint" else self.prompts)(local)
        return args + extra + ([] if "--dry-run" in args else REDUCE)


def _run_module(sb: Sandbox, env: dict, module: str, args: list[str], where: str) -> None:
    for k, v in env.items():
        sb.mp.setenv(k, v)
    mod = importlib.import_module(module)
    assert hasattr(mod, "main"), f"{where}: {module} has no main()"
    try:
        rc = mod.main(args)
    except SystemExit as e:
        rc = e.code
    assert rc in (0, None) or not isinstance(rc, int), f"{where}: python -m {module} {shlex.join(args)} -> {rc}"


def _run_torchrun(sb: Sandbox, env: dict, argv: list[str], where: str) -> None:
    from tests.dist import free_port

    launcher = argv[:1] if argv[0] == "torchrun" else argv[:3]
    rest = argv[len(launcher):]
    m = rest.index("-m")
    opts, target = rest[:m], rest[m:]
    for k, a in enumerate(opts):
        if a.startswith("--nproc") and "=" not in a:
            opts[k + 1] = str(min(int(opts[k + 1]), MAX_PROCS))
        elif a.startswith("--nproc"):
            opts[k] = f"{a.split('=')[0]}={min(int(a.split('=')[1]), MAX_PROCS)}"
    if "--standalone" in opts:
        opts = [*opts, f"--master_port={free_port()}"]
    module, args = target[1], sb.provide(target[1], target[2:])
    cmd = [sys.executable, "-m", "torch.distributed.run", *opts, "-m", module, *args]
    full = dict(os.environ, OMP_NUM_THREADS="1", **env,
                PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(cmd, cwd=sb.root, env=full, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{where}: {shlex.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"


def run_page(page: str, root: str, monkeypatch) -> list[str]:
    """Run every runnable block of `page` in order in the sandbox `root`; the commands run."""
    sb = Sandbox(root, monkeypatch)
    done, t0 = [], time.perf_counter()
    for b in page_blocks(page):
        where = f"{b.page}:{b.line}"
        if b.kind == "data" or b.skip is not None:
            continue
        if b.kind == "python":
            code = sb.remap(b.text)
            exec(compile(code, where, "exec"), {"__name__": "__doc_snippet__"})  # noqa: S102 - the doc's own code
            done.append(f"{time.perf_counter() - t0:6.1f} s {where}: python snippet")
            continue
        for argv in commands(sb.remap(b.text)):
            if not_run(argv) is not None:
                continue
            env, argv = _env_and_argv(argv)
            if runner(argv) == "module":
                _run_module(sb, env, argv[2], sb.provide(argv[2], argv[3:]), where)
            else:
                _run_torchrun(sb, env, argv, where)
            done.append(f"{time.perf_counter() - t0:6.1f} s {where}: {shlex.join(argv)[:100]}")
    return done


RUNNABLE = [p for p in DOCS if any(b.kind != "data" and b.skip is None for b in page_blocks(p))]


@pytest.mark.slow  # runs the pages' torchrun jobs
@pytest.mark.parametrize("page", RUNNABLE)
def test_page_commands_run(page, tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    done = run_page(page, str(tmp_path), monkeypatch)
    print("\n".join(done))
