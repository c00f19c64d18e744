"""``tplower explain``, ``bench``, ``codegen`` and ``verify --input-placement``: bad input is one line naming the
option and the fix, exit 2; a mode or kind that cannot run shows as refused, with the reason, and is never
recommended.

Every command runs in this process (``tplower.cli.main``) and is refused before any rank starts. The expected
words are worked out from the input by hand (divisors, byte counts), not copied from the code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tplower.cli import main

ROOT = Path(__file__).parent.parent
BLOCK_SP = str(ROOT / "examples/plans/block_sp.yaml")


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own refusals exit through SystemExit
        rc = int(exc.code or 0)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture
def mlp_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A correct plan file for ``test_cli_errors:build_mlp`` (importable as ``--module``)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    path = tmp_path / "mlp.json"
    path.write_text(json.dumps({"up": "colwise", "down": "rowwise"}))
    return str(path)


# (argv with {plan} for a good plan file and {out} for an empty folder, words the one line must hold, a package)
REFUSALS = [
    # --context: head counts no attention layer has; 4096 / 30 is no whole head size, the nearest divisors are 32, 16
    pytest.param(["explain", "--context", "batch=1,seq=8192,hidden=4096,heads=30,kv_heads=6", "--mesh", "cp=4"],
                 ["--context 'batch=1,seq=8192,hidden=4096,heads=30,kv_heads=6'", "heads=30 does not divide "
                  "hidden=4096", "e.g. 16 or 32", "head_dim=D"], None, id="context-hidden-over-heads"),
    pytest.param(["explain", "--context", "batch=1,seq=8192,hidden=4096,heads=32,kv_heads=5", "--mesh", "cp=4"],
                 ["kv_heads=5 does not divide heads=32", "kv_heads is one of 1, 2, 4, 8, 16, 32"], None,
                 id="context-kv-heads"),
    pytest.param(["explain", "--context", "batch=1,seq=64,hidden=3840,heads=30,kv_heads=6", "--mesh", "cp=2,tp=4"],
                 ["with --mesh cp=2,tp=4", "tp=4 does not divide heads=30 and kv_heads=6", "tp is one of 1, 2, 3, 6"],
                 None, id="context-tp-heads"),
    pytest.param(["explain", "--context", "batch=0,seq=64,hidden=64,heads=4,kv_heads=2", "--mesh", "cp=2"],
                 ["--context", "batch=0; each size is a whole number of at least 1"], None, id="context-zero-batch"),
    # --plan on a mesh without the tp axis its styles shard over
    pytest.param(["explain", "--plan", BLOCK_SP, "--mesh", "dp=2"],
                 ["--plan", "axis named tp", "--mesh dp=2 has none", "do nothing", "--mesh dp=2,tp=2"], None,
                 id="plan-mesh-without-tp"),
    pytest.param(["explain", "--plan", "auto", "--model", "llama-tiny", "--mesh", "dp=2"],
                 ["--mesh dp=2 has none", "--mesh dp=2,tp=2"], "transformers", id="plan-model-mesh-without-tp"),
    # --moe: the user's own key names
    pytest.param(["explain", "--moe", "tokens=64,hidden=8,top_k=8,experts=7"],
                 ["--moe 'tokens=64,hidden=8,top_k=8,experts=7'", "top_k=8 exceeds experts=7", "at most 7"], None,
                 id="moe-top-k"),
    pytest.param(["explain", "--moe", "tokens=64,hidden=8,top_k=0,experts=8"], ["--moe", "top_k=0", "at least 1"],
                 None, id="moe-zero"),
    # a shard dim past the shape: the default --shape is 8,16 (two dims; docs/explain.md)
    pytest.param(["explain", "S(5)", "R"],
                 ["SRC 'S(5)'", "at least 6 dims", "--shape's default 8,16 (2 dims)", "pass --shape"], None,
                 id="shard-dim-past-default-shape"),
    pytest.param(["explain", "R", "S(-3)", "--shape", "4,4"],
                 ["DST 'S(-3)'", "at least 3 dims", "the shape is --shape 4,4 (2 dims)"], None,
                 id="negative-dim-past-shape"),
    pytest.param(["explain", "S(0)", "R", "--grad", "S(2)", "--shape", "7"],
                 ["--grad 'S(2)'", "at least 3 dims", "--shape 7 (1 dim)"], None, id="grad-dim-past-shape"),
    # verify --input-placement: the option, the bad part, the forms an input takes
    pytest.param(["verify", "--module", "test_cli_errors:build_mlp", "--plan", "{plan}", "--input-placement", "0=Q"],
                 ["--input-placement '0=Q'", "'Q' is not a placement", "R (whole on every rank)", "S(d)"], None,
                 id="input-placement-bad"),
    pytest.param(["verify", "--module", "test_cli_errors:build_mlp", "--plan", "{plan}", "--input-placement",
                  "0=P(sum)"], ["--input-placement '0=P(sum)'", "cannot be partial", "R (whole"], None,
                 id="input-placement-partial"),
    pytest.param(["verify", "--module", "test_cli_errors:build_mlp", "--plan", "{plan}", "--input-placement", "S(1)"],
                 ["--input-placement 'S(1)'", "KEY=PLACEMENT", "e.g. 0=S(1)"], None, id="input-placement-no-key"),
    # bench: the options' names and the closest valid value
    pytest.param(["bench", "--phases", "micr", "--out", "{out}"],
                 ["--phases: 'micr' is unknown", "did you mean 'micro'", "allowed: micro,"], None, id="bench-phase"),
    pytest.param(["bench", "--phases", "micro", "--impls", "tplwer", "--out", "{out}"],
                 ["--impls: 'tplwer' is unknown", "did you mean 'tplower'"], None, id="bench-impl"),
    pytest.param(["bench", "--phases", "micro", "--cases", "S(0)->S(2)", "--out", "{out}"],
                 ["--cases: 'S(0)->S(2)' is unknown", "did you mean 'S(0)->S(1)'"], None, id="bench-case"),
    pytest.param(["bench", "--phases", ",", "--out", "{out}"], ["--phases names none", "micro"], None,
                 id="bench-no-phase"),
    pytest.param(["bench", "--phases", "micro", "--worlds", "1", "--out", "{out}"], ["--worlds: 1 is below 2"], None,
                 id="bench-world-1"),
    # 1 KiB over world 3: float32 [a, b] with 3 | a and 3 | b needs multiples of 4 * 3 * 3 = 36 B; 29 * 36 = 1044
    pytest.param(["bench", "--phases", "micro", "--worlds", "3", "--sizes", "1KiB", "--out", "{out}"],
                 ["--sizes: 1024 B", "world 3 (--worlds 3)", "multiples of 36 B (e.g. 1044)"], None,
                 id="bench-size-world-3"),
    # codegen --experts ep is read only with --plan auto
    pytest.param(["codegen", "--module", "test_cli_errors:build_mlp", "--plan", "{plan}", "--experts", "ep"],
                 ["--experts ep is read with --plan auto", "ignores it", "add --plan auto"], None,
                 id="codegen-ep-with-plan-file"),
    pytest.param(["codegen", "--model", "llama-tiny", "--experts", "ep"],
                 ["--experts ep", "the model's default plan (no --plan)", "add --plan auto"], "transformers",
                 id="codegen-ep-default-plan"),
]


@pytest.mark.parametrize(("argv", "words", "package"), REFUSALS)
def test_bad_input_is_one_line_exit_2(argv: list[str], words: list[str], package: str | None, mlp_plan: str,
                                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if package is not None:
        pytest.importorskip(package)
    out = tmp_path / "out"
    out.mkdir()
    rc, _, err = _run([a.format(plan=mlp_plan, out=out) for a in argv], capsys)
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"tplower {argv[0]}: error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not list(out.iterdir())  # nothing ran, nothing written


def test_refused_ulysses_shows_as_refused_and_is_not_recommended(capsys: pytest.CaptureFixture[str]) -> None:
    # 30 heads over cp=4: Ulysses cannot split them; allgather runs. By hand: 8192 tokens over 4 ranks = 2048 a
    # piece, head size 3840 / 30 = 128, fp32: one head's piece 2048 * 128 * 4 B = 1 MiB; K and V gathered (6 kv
    # heads, 3 other ranks) = 2 * 3 * 6 MiB = 36 MiB, their gradients reduce-scattered as much: 72 MiB a step
    argv = ["explain", "--context", "batch=1,seq=8192,hidden=3840,heads=30,kv_heads=6", "--mesh", "cp=4"]
    rc, out, err = _run(argv, capsys)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    uly = next(line for line in lines if line.startswith("context_mode='ulysses'"))
    assert uly.startswith("context_mode='ulysses': refused: ")
    assert "the 30 query heads do not divide over cp=4" in uly and uly.endswith("1, 2, 3, 5, 6, 10, 15, 30")
    assert "S(seq) <-> S(heads))" not in out  # no Ulysses rows (and no 0 B) for a mode that does not run
    assert "key, value (S(seq) -> R)                 all_gather      2      36.0 MiB" in out
    # the hybrid runs too, as 2 groups of 2 (2 divides the 30 query and 6 key/value heads, 4 does not): Ulysses over
    # 2 ranks sends half of q and the output (15 heads) 4 times, 60 MiB, and of k and v (3 heads) 12 MiB; the
    # group's k and v (6 heads of 2 pieces = 12 MiB) gathered from the one other group, 12 MiB, and their
    # gradients reduce-scattered as much: 96 MiB a step, more than allgather's 72
    assert "context_mode='hybrid' (context_ulysses=2: 2 x 2)" in lines
    assert "query, output (S(seq) <-> S(heads) inside groups of 2)   all_to_all      4      60.0 MiB" in out
    assert "key, value (S(seq) -> R across 2 groups)                 all_gather      2      12.0 MiB" in out
    assert lines[-1] == "fewer bytes per step: allgather (72.0 MiB; hybrid 96.0 MiB)"  # ulysses never recommended
    rc, out, _ = _run([*argv, "--json"], capsys)
    info = json.loads(out)
    assert rc == 0 and info["ulysses"]["possible"] is False and info["ulysses"]["rows"] == []
    assert info["ulysses"]["step_bytes_per_rank"] is None and info["allgather"]["possible"] is True
    assert info["allgather"]["step_bytes_per_rank"] == 72 * 2**20 + 6  # + the loss: 2 * 3/4 of 4 B
    assert info["hybrid"]["step_bytes_per_rank"] == 96 * 2**20 + 6 and info["inputs"]["ulysses"] == 2
    # a degree the heads do not take: refused with the degrees that run
    rc, out, _ = _run(["explain", "--context", "batch=1,seq=64,hidden=48,heads=3,kv_heads=1,ulysses=2", "--mesh",
                       "cp=4"], capsys)
    assert rc == 0 and ("context_mode='hybrid' (context_ulysses=2: 2 x 2): refused: ulysses=2 splits the 3 query "
                        "heads per rank over 2 ranks, which does not divide them; degrees that divide cp=4 and them: "
                        "1") in out.splitlines()


def test_refused_ulysses_counts_heads_per_tp_rank(capsys: pytest.CaptureFixture[str]) -> None:
    # tp=3 leaves 10 of the 30 heads on a rank; 10 over cp=4 does not divide, over 1, 2, 5 or 10 it does
    rc, out, _ = _run(["explain", "--context", "batch=1,seq=64,hidden=3840,heads=30,kv_heads=6", "--mesh",
                       "cp=4,tp=3"], capsys)
    assert rc == 0
    assert "the 10 query heads per rank (heads=30 / tp=3) do not divide over cp=4; cp sizes that divide them: " \
           "1, 2, 5, 10" in out


def test_moe_explains_tp_when_only_ep_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # 127 experts (a prime) over tp=8: no rank can hold whole experts, tensor parallelism inside them still runs.
    # By hand: the output [4096, 2048] fp32 is 32 MiB; an all_reduce over 8 sends 2 * 7/8 of it = 56 MiB; backward
    # the same for the hidden states and 2 * 7/8 * 4096 * 8 * 4 B = 224 KiB for the routing weights: 112.2 MiB
    rc, out, err = _run(["explain", "--moe", "tokens=4096,hidden=2048,top_k=8,experts=127", "--mesh", "tp=8"],
                        capsys)
    assert rc == 0 and err == ""
    assert "block output               all_reduce  (4096, 2048)  56.0 MiB" in out
    assert "total per rank: forward 56.0 MiB, backward 56.2 MiB, step 112.2 MiB" in out
    ep = next(line for line in out.splitlines() if line.startswith("expert parallelism"))
    assert ep.startswith("expert parallelism (experts='ep'): refused: 127 experts do not divide over 8 ranks")
    assert ep.endswith("rank counts that divide them: 1, 127")
    assert "all_to_all" not in out and "fewer bytes" not in out
    assert out.splitlines()[-1] == ("use tensor parallelism inside the experts, the only kind that runs here "
                                    "(112.2 MiB per rank per step)")
