"""The model and plan a command works on, checked in this process before any rank starts.

``--model NAME`` (a model of ``tplower run``) or ``--module PKG:ATTR`` (the
user's own factory), ``--plan FILE|auto|derive`` (any letter case), and
:func:`check_plan`: every refusal :func:`tplower.parallelize` would make in
each rank (a misspelled key, a style typo, a malformed file, ``--experts ep``
on a dense model, a head count the mesh does not divide), made once here on
the model's skeleton and a ``fake`` process group, as one line.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.support.errors import TPLowerError
from .errors import plan_keyword

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["add_model_arguments", "build_module", "check_keys", "check_plan", "fake_mesh", "import_attr", "plan_value"]


def add_model_arguments(parser: argparse.ArgumentParser, model_help: str = "a model tplower run knows") -> None:
    """``--model NAME`` or ``--module PKG:ATTR`` (one required), ``--plan FILE|auto|derive`` and ``--experts``."""
    from ..run.models import MODELS

    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", choices=sorted(MODELS), help=model_help)
    src.add_argument("--module", metavar="PKG:ATTR", help="import ATTR from PKG: a callable returning the model "
                     "(PKG must be importable: a file or package in this folder needs PYTHONPATH=.)")
    parser.add_argument("--plan", metavar="FILE|auto|derive",
                        help="plan file (YAML/JSON), 'auto' (a transformers model's own plan) or 'derive' (a plan "
                             "derived from the module structure); default for --model: its plan")
    parser.add_argument("--experts", default="tp", choices=("tp", "ep"),
                        help="with --plan auto, how mixture-of-experts blocks are parallelized: tp (tensor "
                             "parallelism inside the experts, default) or ep (expert parallelism: experts sharded "
                             "by index, tokens dispatched to them)")


def import_attr(path: str, option: str = "--module") -> tuple[Any, Any]:
    """``PKG:ATTR`` -> (the attribute, the module).

    Raises:
        TPLowerError: not ``PKG:ATTR``, a package that cannot be imported (with the ``PYTHONPATH=.`` hint when
            it is the package itself that is missing), an import that raised, or no such attribute.
    """
    mod_name, sep, attr = path.partition(":")
    if not sep or not mod_name or not attr:
        raise TPLowerError(f"{option} {path!r}: write it as PKG:ATTR, e.g. mypkg.models:build")
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and mod_name.split(".")[0] == exc.name.split(".")[0]:
            raise TPLowerError(f"{option} {path!r}: the module {mod_name!r} cannot be imported ({exc}); if it is a "
                               "file or package in this folder, run with PYTHONPATH=. (e.g. PYTHONPATH=. tplower "
                               "...), else install it") from None
        raise TPLowerError(f"{option} {path!r}: importing {mod_name!r} failed: {exc}; install what it "
                           "needs") from None
    except Exception as exc:
        raise TPLowerError(f"{option} {path!r}: importing {mod_name!r} raised {type(exc).__name__}: {exc}") from None
    if not hasattr(mod, attr):
        raise TPLowerError(f"{option} {path!r}: {mod_name!r} has no attribute {attr!r}")
    return getattr(mod, attr), mod


def build_module(path: str, *, meta: bool = False) -> nn.Module:
    """The model ``--module PKG:ATTR`` gives: ``ATTR()`` (a class or factory) or ``ATTR`` itself (a module).

    Args:
        path: ``PKG:ATTR``.
        meta: build on the meta device (no memory, for checking a plan); a factory that cannot build there is
            called as is.

    Raises:
        TPLowerError: as :func:`import_attr`, a factory that raised, or a result that is not an ``nn.Module``.
    """
    import torch
    from torch import nn

    factory, _ = import_attr(path)
    if isinstance(factory, nn.Module) or not callable(factory):
        model = factory
    else:
        model = None
        if meta:
            with contextlib.suppress(Exception), torch.device("meta"):
                model = factory()
        if model is None:
            try:
                model = factory()
            except Exception as exc:
                raise TPLowerError(f"--module {path!r}: calling it raised {type(exc).__name__}: {exc} (it must "
                                   "build the model with no arguments)") from None
    if not isinstance(model, nn.Module):
        raise TPLowerError(f"--module {path!r} gave a {type(model).__name__}, not a torch.nn.Module")
    return model


def plan_value(plan: str | None) -> str | None:
    """``--plan`` as the library takes it: ``auto``/``derive`` in lower case, else a file that must exist.

    Raises:
        TPLowerError: a path that is no file.
    """
    plan = plan_keyword(plan)
    if plan is not None and plan not in ("auto", "derive") and not Path(plan).is_file():
        raise TPLowerError(f"--plan {plan!r}: no such file (or write 'auto' for a transformers model's own plan, "
                           "'derive' for one derived from the module structure)")
    return plan


@contextlib.contextmanager
def fake_mesh(names: tuple[str, ...], sizes: tuple[int, ...], command: str) -> Iterator[DeviceMesh]:
    """A device mesh of ``sizes`` on PyTorch's ``fake`` process group in this process (rank 0; nothing moves).

    Raises:
        TPLowerError: a process group exists already (the command runs without one of its own).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise TPLowerError(f"tplower {command} runs without a process group of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(sizes))
    try:
        yield init_device_mesh("cpu", sizes, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


def _check_auto(model: nn.Module, experts: str) -> None:
    from ..plans.hf import model_ep_plan, model_tp_plan

    try:
        model_tp_plan(model)
    except TPLowerError:
        raise TPLowerError(f"--plan auto: {type(model).__name__} ships no tensor-parallel plan (no tp_plan or "
                           "config.base_model_tp_plan); use --plan derive (a plan derived from its module "
                           "structure; tplower plan writes it out for editing) or --plan FILE") from None
    if experts == "ep":
        try:
            model_ep_plan(model)
        except TPLowerError:
            raise TPLowerError(f"--experts ep: {type(model).__name__} ships no expert-parallel plan (a dense model "
                               "has no experts to shard); drop --experts ep, or give --plan FILE with "
                               "grouped_gemm entries") from None


def _check_experts(plan: Any, experts: str) -> None:
    """``--experts ep`` is read only with ``--plan auto``: any other plan shards experts by its own entries.

    Raises:
        TPLowerError: ``experts`` is ``"ep"`` and ``plan`` is not ``"auto"`` (the option would be ignored).
    """
    if experts != "ep" or plan == "auto":
        return
    given = ("--plan derive (a derived plan)" if plan == "derive" else f"--plan {str(plan)!r}"
             if isinstance(plan, str | Path) else "the model's default plan (no --plan)")
    raise TPLowerError(f"--experts ep is read with --plan auto (a transformers model's own expert-parallel plan), "
                       f"and {given} ignores it; add --plan auto, or drop --experts ep (a plan file shards experts "
                       "by its own entries: grouped_gemm for expert parallelism)")


def check_keys(model: nn.Module, plan: Any, experts: str = "tp") -> None:
    """The checks of :func:`check_plan` that need no mesh: the plan file, its keys, ``auto`` and ``--experts ep``.

    Raises:
        TPLowerError: a file that cannot be read or breaks the schema, a key naming no module of ``model``
            (with the closest names), ``auto`` on a model that ships no plan (pointing at ``derive``), ``ep``
            on a model that ships no expert-parallel plan, ``ep`` with a plan other than ``auto`` (which would
            ignore it).
    """
    from ..plans.hf import resolve_model_plan
    from ..plans.keys import check_plan_keys

    _check_experts(plan, experts)
    if plan == "auto":
        _check_auto(model, experts)
    elif plan != "derive":
        try:  # keys as written, else under the base model's prefix: as parallelize reads them
            keyed = resolve_model_plan(plan, model, experts=experts)
        except ImportError:
            raise TPLowerError(f"--plan {str(plan)!r} is YAML, which needs PyYAML: pip install pyyaml") from None
        except ValueError as exc:  # TPLowerError: a file that cannot be read or parsed, an entry off the schema
            where = f"--plan {str(plan)!r}: " if isinstance(plan, str | Path) and "plan file" not in str(exc) else ""
            raise TPLowerError(f"{where}{exc}") from None
        check_plan_keys([*(n for n, _ in model.named_modules()), *(n for n, _ in model.named_parameters())], keyed,
                        type(model).__name__)


def check_plan(model: nn.Module, plan: Any, names: tuple[str, ...], sizes: tuple[int, ...], *, axis: str = "tp",
               experts: str = "tp", command: str, context: str | None = None, context_mode: str = "ulysses") -> None:
    """Resolve ``plan`` on ``model`` as :func:`tplower.parallelize` would on a mesh of ``sizes``; the model is left
    as it was.

    Args:
        model: the model, or its meta-device skeleton.
        plan: a mapping, a file path, ``"auto"`` or ``"derive"`` (lower case: :func:`plan_value`).
        names, sizes: the mesh's axes and their sizes.
        axis, experts, context, context_mode: as :func:`tplower.parallelize` (with ``context``, context
            parallelism is installed on a copy of ``model``, so its refusals come here too).
        command: the subcommand, for messages.

    Raises:
        TPLowerError: every refusal ``parallelize`` makes before it changes a model, a plan key naming no
            module (with the closest names), and ``auto`` on a model that ships no plan (pointing at ``derive``).
    """
    from ..nn.resolve import resolve_plan

    check_keys(model, plan, experts)
    with fake_mesh(names, sizes, command) as mesh:
        resolved = resolve_plan(model, mesh, plan, axis=axis, experts=experts, context=context)
        if context is not None:
            import copy

            from ..context.install import install_context
            from ..nn.parallelize import attention_tp

            install_context(copy.deepcopy(model), mesh, context, context_mode,
                            tp_size=attention_tp(model, resolved))
