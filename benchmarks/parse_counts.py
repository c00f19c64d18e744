"""How many times one ``parallelize(model, mesh, "auto")`` on tiny Llama reads plan text.

A ``sys.setprofile`` trace of the call (a 1-rank gloo group, so no other process is needed; ``--world 2`` runs
two threads of the threaded process group instead) counts the calls of the functions that read placement text or
turn plan values into entries, and the functions they are called from:

* ``parse_placement`` (one placement: ``"S(0)"``), ``parse_placements`` (a whole mesh's placements),
  ``plans.forms.parse_spec`` (an entry's placement bound to the mesh's axes), ``plans.entries.resolve_entry``
  (a plan value into an entry), ``plans.entries.read_value`` (a plan value read, where it exists),
  ``plans.styles.entry_from_style`` (an HF style into entry fields);

each with how many of its calls were given text (a string, or a mapping or sequence holding one: text parsed
there) and how many typed values only (placements, entries: nothing to parse).

Run: ``OMP_NUM_THREADS=1 python benchmarks/parse_counts.py [--model llama] [--world 1|2]``. Nothing here is
asserted by a test; the counts describe the code as it is, for a before/after comparison.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.run.hf_configs import architectures, tiny_model

#: (file under the package, function name) of each reader counted
READERS: tuple[tuple[str, str], ...] = (
    ("core/language/placements.py", "parse_placement"),
    ("core/language/placements.py", "parse_placements"),
    ("plans/forms.py", "parse_spec"),
    ("plans/entries.py", "resolve_entry"),
    ("plans/entries.py", "read_value"),
    ("plans/styles.py", "entry_from_style"),
)


Counted = tuple[Counter[str], dict[str, set[tuple[str, str]]], Counter[str]]


def _has_text(arg: object) -> bool:
    """A string, or a mapping or sequence with one among its values (one level down, as plan values nest)."""
    if isinstance(arg, str):
        return True
    values = arg.values() if isinstance(arg, Mapping) else arg if isinstance(arg, list | tuple) else ()
    return any(isinstance(v, str) or (isinstance(v, Mapping) and any(isinstance(w, str) for w in v.values()))
               for v in values)


def _count(model_type: str, mesh: Any) -> Counted:
    """Calls of each reader, the functions it is called from, and its calls given text."""
    root = Path(tplower.__file__).resolve().parent
    wanted = {(str(root / f), name): name for f, name in READERS}
    calls: Counter[str] = Counter()
    sites: dict[str, set[tuple[str, str]]] = {}
    text: Counter[str] = Counter()

    def prof(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        name = wanted.get((frame.f_code.co_filename, frame.f_code.co_name))
        if name is None:
            return
        calls[name] += 1
        back = frame.f_back
        if back is not None:
            sites.setdefault(name, set()).add((Path(back.f_code.co_filename).name, back.f_code.co_name))
        if _has_text(frame.f_locals.get(frame.f_code.co_varnames[0])):
            text[name] += 1

    model = tiny_model(architectures([model_type])[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sys.setprofile(prof)
        try:
            tplower.parallelize(model, mesh, "auto")
        finally:
            sys.setprofile(None)
    return calls, sites, text


def _print(model_type: str, world: int, counted: Counted) -> None:
    calls, sites, text = counted
    print(f"parallelize(tiny {model_type}, mesh tp={world}, 'auto'): calls, given text, (functions calling it)")
    for _, name in READERS:
        callers = sorted(f"{f}:{fn}" for f, fn in sites.get(name, ()))
        print(f"  {name:<18} {calls[name]:>5} {text[name]:>5}  ({len(callers)}: {', '.join(callers)})")


def _one_rank(model_type: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            _print(model_type, 1, _count(model_type, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))))
        finally:
            dist.destroy_process_group()


def _two_ranks(model_type: str) -> None:
    from tplower.testing import run_threaded

    def body(rank: int, world: int) -> Counted | None:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        if rank == 0:  # one rank traced (sys.setprofile is per thread); the other runs the same call untraced
            return _count(model_type, mesh)
        tplower.parallelize(tiny_model(architectures([model_type])[0]), mesh, "auto")
        return None

    got = run_threaded(2, body)
    first = got[0]
    assert first is not None
    _print(model_type, 2, first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama", help="a model type of tplower.run.hf_configs (default: llama)")
    ap.add_argument("--world", type=int, choices=(1, 2), default=1, help="tp size (2: threaded process group)")
    a = ap.parse_args()
    (_one_rank if a.world == 1 else _two_ranks)(a.model)


if __name__ == "__main__":
    main()
