"""``tplower plan``: derive a tensor-parallel plan from a model's module structure and write it out for editing.

    tplower plan --model all-minilm-l6-v2 -o minilm_plan.yaml
    tplower plan --model t5_encoder            # a tiny family of tplower.run.derive_table, printed

The plan (YAML, or JSON for a ``.json`` file) is what ``parallelize(model,
mesh, "derive")`` and ``tplower run --plan derive`` apply; each rule that
matched is printed to stderr (``tplower.nn.derive``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..core.errors import TPLowerError

__all__ = ["add_arguments", "derive_for", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``-o``, ``--embeddings``, ``--axis``."""
    parser.add_argument("--model", required=True,
                        help="a model of tplower run (all-minilm-l6-v2, llama-tiny) or a family of "
                             "tplower.run.derive_table (bert, t5_encoder, ...)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the plan here (.yaml/.yml or .json); "
                        "default: print YAML")
    parser.add_argument("--embeddings", action="store_true",
                        help="also shard word embeddings (vocabulary-parallel) and an output head of the vocabulary")
    parser.add_argument("--axis", default="tp", help="the tensor-parallel mesh axis (default tp)")


def derive_for(name: str, *, embeddings: bool = False, axis: str = "tp") -> Any:
    """The :class:`tplower.nn.derive.DerivedPlan` of a ``tplower run`` model (its meta skeleton) or a tiny family.

    Raises:
        TPLowerError: an unknown name (the message lists the known ones), or no rule matched.
    """
    from ..nn.derive import derive_plan
    from ..run.derive_table import FAMILIES, tiny_family
    from ..run.models import MODELS, skeleton
    from ..run.quiet import quiet_transformers

    with quiet_transformers():
        if name in MODELS:
            model = skeleton(name)
        elif name in FAMILIES:
            model = tiny_family(name)[0]
        else:
            raise TPLowerError(f"--model {name!r} is neither a model of tplower run ({', '.join(sorted(MODELS))}) "
                               f"nor a family ({', '.join(FAMILIES)})")
    return derive_plan(model, embeddings=embeddings, axis=axis)


def main(args: argparse.Namespace) -> int:
    """Write (or print) the derived plan and print the rules to stderr; exit 2 on an error."""
    try:
        derived = derive_for(args.model, embeddings=args.embeddings, axis=args.axis)
    except TPLowerError as exc:
        print(f"tplower plan: error: {exc}", file=sys.stderr)
        return 2
    import importlib

    yaml: Any = importlib.import_module("yaml")
    print(derived.explain(), file=sys.stderr)
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in derived.plan.items()}
    if args.output and Path(args.output).suffix.lower() == ".json":
        text = json.dumps(data, indent=2) + "\n"
    else:
        text = f"# tplower plan --model {args.model}: derived from the module structure; edit freely\n" + \
            yaml.safe_dump(data, sort_keys=False)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
