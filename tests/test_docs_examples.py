"""Every example of ``README.md`` and ``docs/*.md`` runs as written, and every output shown is what the command prints.

A fenced block's kind comes from its language and from a marker comment on the line before it:

==============================================  =====================================================================
block                                           checked by
==============================================  =====================================================================
```` ```python ````                             runs in this process, in a fresh namespace
```` ```python ```` starting ``# torchrun         runs on 2 gloo ranks: one torchrun launch runs the blocks one after
--nproc-per-node 2``                            another in each rank, each with a store of its own
```` ```bash ````                               ``bash -n``; the files, folders and modules it names exist
```` ```yaml ````                               loads as a plan (:func:`tplower.load_plan`)
``<!-- docs: output of `CMD` -->``              the block is what the ``tplower`` command ``CMD`` prints
``<!-- docs: excerpt of `CMD` -->``             each part of the block (parts end at two blank lines) is in its output
``<!-- docs: not run: REASON -->``              listed in :data:`NOT_RUN`, so nothing is left out silently
==============================================  =====================================================================

Any other block fails :func:`test_every_block_has_a_kind`. The README's example always runs; the pages' torchrun
blocks that need transformers, PEFT, accelerate, ``torch.compile``, ``tplower.verify`` or ``tplower.codegen`` (their
checks also run in the suite's own tests) and the outputs of ``tplower verify`` and ``tplower codegen`` run with
``TPLOWER_SLOW=1``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch.distributed as dist

import tplower
from tplower.cli import main as tplower_main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
SLOW = os.environ.get("TPLOWER_SLOW") == "1"
TORCHRUN = "# torchrun --nproc-per-node 2"
MARKER = re.compile(r"<!-- docs: (output of|excerpt of|not run:) ?(.*?) ?-->$")
#: a torchrun block that imports one of these, compiles, verifies or generates code is slow (seconds each on 2 cores);
#: the same checks run in the suite's own tests (test_hf_workflow, test_context, test_compile, test_verify, ...)
SLOW_NEEDS = re.compile(
    r"^(from|import) (transformers|peft|accelerate)\b|torch\.compile|tplower\.(verify|codegen)\b", re.M
)
#: outputs of these commands are slow to make (ranks started, a real model loaded)
SLOW_COMMANDS = ("tplower verify", "tplower codegen")

#: (page, reason) of every block that is shown but not run
NOT_RUN = {
    ("docs/context.md", "needs 4 ranks; tests/test_context_tp.py runs it at cp=2 x tp=2"),
    ("docs/context.md", "needs 4 ranks; tests/test_context_fsdp.py runs it"),
    ("docs/design.md", "a picture of the package's folders"),
    ("docs/layout.md", "needs 8 GPUs; tests/test_planner.py runs prepare_trainer(trainer, \"auto\") on 2 ranks"),
    ("docs/training-stacks.md", "needs 4 ranks; tests/test_hf_stacks.py runs dp=2 x tp=2 and dp=2 x cp=2 "
                                "(TPLOWER_SLOW=1)"),
}


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text and the marker before it."""

    page: str
    line: int
    lang: str
    text: str
    marker: tuple[str, str] | None

    @property
    def id(self) -> str:
        """``page:line``, the test id."""
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        """``torchrun``, ``python``, ``shell``, ``plan``, ``output``, ``excerpt``, ``not run`` or ``unknown``."""
        if self.marker is not None:
            return {"output of": "output", "excerpt of": "excerpt", "not run:": "not run"}[self.marker[0]]
        if self.lang == "python":
            return "torchrun" if self.text.startswith(TORCHRUN) else "python"
        return {"bash": "shell", "yaml": "plan"}.get(self.lang, "unknown")


def blocks_of(path: Path) -> Iterator[Block]:
    """The fenced blocks of one Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        start, lang = i, lines[i][3:].strip().split(" ")[0]
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = lines[start - 1].strip() if start else ""
        found = MARKER.match(before)
        marker = (found.group(1), found.group(2).strip("`")) if found else None
        yield Block(
            path.relative_to(ROOT).as_posix(), start + 1, lang, "\n".join(lines[start + 1 : end]) + "\n", marker
        )
        i = end + 1


BLOCKS = [b for page in PAGES for b in blocks_of(page)]


def of_kind(*kinds: str) -> list[Block]:
    """The blocks of these kinds."""
    return [b for b in BLOCKS if b.kind in kinds]


def test_every_block_has_a_kind() -> None:
    counts: dict[str, int] = {}
    for b in BLOCKS:
        counts[b.kind] = counts.get(b.kind, 0) + 1
    print("documentation blocks:", json.dumps(counts, sort_keys=True))
    assert not of_kind("unknown"), [f"{b.id} ({b.lang or 'no language'}): add a marker" for b in of_kind("unknown")]
    assert {(b.page, b.marker[1]) for b in of_kind("not run") if b.marker} == NOT_RUN
    assert counts.get("torchrun", 0) >= 10 and counts.get("python", 0) >= 3  # the extractor finds the examples


def test_readme_starts_with_the_setup_and_test_commands() -> None:
    first = BLOCKS[0]
    assert (first.page, first.lang) == ("README.md", "bash")
    setup, tests = first.text.splitlines()
    assert setup.endswith('pip install "torch==2.13.0" -e ".[dev]" && tplower')
    assert tests.endswith("python -m pytest -q")
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()  # the command CI runs


def test_every_public_name_has_a_reference_entry() -> None:
    entries = set(
        re.findall(r"^::: tplower\.(\w+)$", "".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md")), re.M)
    )
    assert set(tplower.__all__) <= entries, sorted(set(tplower.__all__) - entries)


@pytest.mark.parametrize("block", of_kind("python"), ids=lambda b: b.id)
def test_python_block_runs(block: Block) -> None:
    exec(compile(block.text, block.id, "exec"), {"__name__": "__main__"})
    assert not dist.is_initialized(), f"{block.id} left a process group: end it with dist.destroy_process_group()"


@pytest.mark.parametrize("block", of_kind("plan"), ids=lambda b: b.id)
def test_yaml_block_is_a_plan(block: Block, tmp_path: Path) -> None:
    (tmp_path / "plan.yaml").write_text(block.text)
    assert tplower.load_plan(tmp_path / "plan.yaml")


# ---- shell blocks: they parse, and what they name exists ---------------------------------------------------------

OUTPUT_FLAGS = {"-o", "--output", "--out", "--save", "--checkpoint", "--json"}
FILE = re.compile(r"[\w./-]+\.(py|ya?ml|json|pt|sh|md|txt)$")


def commands(text: str) -> list[list[str]]:
    """Each command of a shell block (continuations joined, ``&&`` and ``;`` split), as words; comments dropped."""
    out: list[list[str]] = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        cmd: list[str] = []
        for w in [*words, "&&"]:
            if w in ("&&", ";", "||", "|"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def _env_prefix(words: list[str]) -> list[str]:
    """The leading ``KEY=VALUE`` words of a command."""
    n = 0
    while n < len(words) - 1 and re.fullmatch(r"[A-Z_]+=\S*", words[n]):
        n += 1
    return words[:n]


def missing_names(text: str) -> list[str]:
    """Files, folders and modules a shell block names that the repository lacks (outputs it writes excepted)."""
    missing, made, paths = [], set(), [ROOT]
    for cmd in commands(text):
        env = _env_prefix(cmd)
        for w in env:
            key, value = w.split("=", 1)
            if key == "PYTHONPATH":
                paths = [ROOT / p for p in value.split(":")] + [ROOT]
                missing += [p for p in value.split(":") if not (ROOT / p).is_dir()]
        words = cmd[len(env) :]
        for prev, word in zip(["", *words], words, strict=False):
            value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
            if prev in OUTPUT_FLAGS:
                made.add(value)
            elif prev == "--module":
                module = value.split(":")[0].replace(".", "/")
                if not any((p / f"{module}.py").is_file() or (p / module / "__init__.py").is_file() for p in paths):
                    missing.append(value)
            elif prev == "-m" and words[0].startswith("python"):
                if find_spec(value) is None:
                    missing.append(value)
            elif (
                (FILE.fullmatch(value) or value.startswith(("examples/", "benchmarks/", "tests/", "docs/")))
                and value not in made
                and not value.startswith((".venv/", "-"))
            ):
                if not (ROOT / value).exists():
                    missing.append(value)
    return missing


@pytest.mark.parametrize("block", of_kind("shell"), ids=lambda b: b.id)
def test_shell_block_parses_and_names_real_files(block: Block) -> None:
    bash = shutil.which("bash")
    assert bash is not None
    done = subprocess.run([bash, "-n"], input=block.text, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert missing_names(block.text) == []


# ---- outputs: the command is run, its output compared -------------------------------------------------------------


def cli_output(command: str) -> str:
    """What ``tplower ...`` prints on standard output, run in this process (``KEY=VALUE`` prefixes set around it)."""
    words = shlex.split(command)
    env = dict(w.split("=", 1) for w in _env_prefix(words))
    argv = words[len(env) :]
    assert argv[0] == "tplower", f"{command!r}: only tplower commands are run"
    assert missing_names(command) == []
    extra = [str(ROOT / p) for p in env.get("PYTHONPATH", "").split(":") if p]
    old_env, old_path, old_cwd = dict(os.environ), list(sys.path), os.getcwd()
    path = [*extra, str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]  # the ranks a command spawns import these
    os.environ.update({**env, "PYTHONPATH": os.pathsep.join(path)} if extra else env)
    sys.path[:0] = extra
    out = io.StringIO()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out):
            tplower_main(argv[1:])
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
        sys.path[:] = old_path
    return out.getvalue()


def _trimmed(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def _slow(block: Block) -> bool:
    return block.marker is not None and any(c in block.marker[1] for c in SLOW_COMMANDS)


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if _slow(b) else []) for b in of_kind("output", "excerpt")],
)
def test_output_block_is_what_the_command_prints(block: Block) -> None:
    assert block.marker is not None
    printed = _trimmed(cli_output(block.marker[1]))
    if block.kind == "output":
        assert _trimmed(block.text) == printed
    for part in block.text.split("\n\n\n"):
        assert _trimmed(part) in printed, f"{block.id}: not in the output of {block.marker[1]!r}:\n{part}"


# ---- torchrun blocks: 2 gloo ranks --------------------------------------------------------------------------------

DRIVER = '''"""Run documentation blocks one after another in each rank, each in a fresh namespace and its own store."""
import json, os, sys, traceback
import torch.distributed as dist

os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 hosts a store per block, on the block's own port
for block in json.loads(open(sys.argv[1]).read()):
    os.environ["MASTER_PORT"] = str(block["port"])
    try:
        exec(compile(block["source"], block["id"], "exec"), {"__name__": "__main__"})
        assert not dist.is_initialized(), "the block did not end with dist.destroy_process_group()"
    except BaseException:
        print(f"BLOCK FAILED {block['id']}", flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    print(f"BLOCK OK {block['id']} rank {os.environ['RANK']}", flush=True)
'''


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(script: str, folder: Path, *args: str, timeout: float) -> tuple[int, str]:
    """``python -m torch.distributed.run --nproc-per-node 2 script`` in ``folder``; (exit code, output).

    The ranks run with one thread each; the launcher and its ranks are ended together on a timeout.
    """
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(folder),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
        script,
        *args,
    ]
    proc = subprocess.Popen(
        cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return -1, f"timed out after {timeout:.0f} s\n{output}"
    return proc.returncode, output


def torchrun_blocks(slow: bool) -> list[Block]:
    """The README's example and the pages' light torchrun blocks, or (``slow``) the pages' heavy ones."""
    return [b for b in of_kind("torchrun") if (b.page != "README.md" and bool(SLOW_NEEDS.search(b.text))) == slow]


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["light", "heavy"])
def test_examples_run_under_torchrun(slow: bool) -> None:
    """One launch of 2 ranks runs the blocks in page order (the README's first), each on a store of its own."""
    blocks = torchrun_blocks(slow)
    assert blocks and (slow or blocks[0].page == "README.md")
    folder = Path(tempfile.mkdtemp(prefix="tplower-docs-"))
    try:
        (folder / "driver.py").write_text(DRIVER)
        (folder / "blocks.json").write_text(
            json.dumps([{"id": b.id, "source": b.text, "port": _free_port()} for b in blocks])
        )
        rc, output = torchrun("driver.py", folder, "blocks.json", timeout=600 if slow else 300)
        # the two ranks share one stdout: a rank's line may begin in the middle of the other's
        ran = re.findall(r"BLOCK OK (\S+) rank \d", output)
        assert rc == 0 and sorted(ran) == sorted(2 * [b.id for b in blocks]), output[-6000:]  # each block, each rank
        if not slow:
            assert output.count("all checks pass") == 2, output[-6000:]  # the README example's own line, per rank
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ---- the example files the pages name ---------------------------------------------------------------------------


def _verify_gathered(rank: int, world: int, model: object, x: object, plan: str) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    report = tplower.verify(
        lambda: copy.deepcopy(model),
        ROOT / "examples" / "plans" / plan,
        mesh,
        x,
        input_placements={0: "S(1)"},
        output_placement="S(2)",
    )
    first = report.first_divergence
    return {"ok": report.ok, "first": None if first is None else (first.module, first.suggestion)}


def test_gathered_example_plans_verify_as_the_pages_say() -> None:
    """examples/gathered.py under its two plans (threaded ranks): the wrong one diverges at the gather, with the fix."""
    from tplower.testing import run_threaded

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from gathered import Gathered, example_inputs
    finally:
        sys.path.remove(str(ROOT / "examples"))
    model, x = Gathered(), example_inputs()  # one model for both ranks: threaded ranks share the global generator
    wrong = run_threaded(2, _verify_gathered, model, x, "gathered_wrong.json")
    assert (
        wrong[0]
        == wrong[1]
        == {
            "ok": False,
            "first": ("gather", "in the plan entry for 'gather' add  in_grad: {'0': {tp: \"P(sum)\"}}"),
        }
    )
    fixed = run_threaded(2, _verify_gathered, model, x, "gathered.json")
    assert fixed[0] == fixed[1] == {"ok": True, "first": None}


@pytest.mark.slow  # MiniLM on 2 ranks under both libraries; the sharing itself is checked in tests/test_fanout.py
def test_the_readme_collective_counts_are_what_the_benchmark_prints() -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "benchmarks/collective_counts.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    readme = (ROOT / "README.md").read_text()
    for library, calls, sent in (("tplower", 24, "4,718,592"), ("parallelize_module", 36, "7,077,888")):
        assert f"| {library} | all_reduce {calls} | {sent} |" in done.stdout, done.stdout
        assert f"{calls} `all_reduce`s, {sent} bytes" in readme or f"{calls}, {sent} bytes" in readme
