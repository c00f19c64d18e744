"""Context parallelism misused: each way refused on every rank before any collective, or answered as one process.

Four threaded ranks (a ``cp=2 x tp=2`` mesh, and a ``cp=4`` one) run every
case once; the tests read what each rank saw: the error text, the collectives
this rank issued while the refused call ran (none; the threaded process
group's collectives are counted per thread, as they bypass the dispatcher
that :class:`~tplower.core.lower.traffic.CollectiveTraffic` watches), and, where
there is a right answer, its largest difference from one process on the whole
batch. The packed-documents case runs on one threaded rank, alone, because it
records warnings (not thread-safe).
"""

from __future__ import annotations

import copy
import inspect
import re
import threading
import typing
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from context_cases import _SEEDED, batch, tiny
from torch.distributed.device_mesh import init_device_mesh

import tplower
from tplower.core.support.errors import TPLowerError
from tplower.testing import run_threaded

TOL = 1e-5
DOCS = Path(__file__).parent.parent / "docs" / "context.md"
#: collectives issued, by thread (a threaded rank), while :func:`_counted` is in force
ISSUED: Counter[int] = Counter()
_COLLECTIVES = ("all_to_all_single", "alltoall", "allreduce", "allreduce_coalesced", "barrier", "allgather",
                "all_gather_single", "broadcast", "scatter", "gather", "reduce_scatter", "reduce_scatter_single",
                "reduce_scatter_single_coalesced", "all_gather_single_coalesced")


@pytest.fixture(scope="module")
def _counted() -> Iterator[None]:
    """Every collective of the threaded process group counted in :data:`ISSUED` under the calling thread."""
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

    saved = {name: getattr(ProcessLocalGroup, name) for name in _COLLECTIVES}

    def counting(run: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            ISSUED[threading.get_ident()] += 1
            return run(self, *args, **kwargs)
        return call

    for name, run in saved.items():
        setattr(ProcessLocalGroup, name, counting(run))
    yield
    for name, run in saved.items():
        setattr(ProcessLocalGroup, name, run)


def _issued() -> int:
    return ISSUED[threading.get_ident()]


def _refused(call: Callable[[], Any]) -> dict[str, Any]:
    """The TPLowerError ``call`` raised (``"no error"`` else, or another type's name and text) and how many
    collectives this rank issued before it."""
    before = _issued()
    try:
        call()
        text = "no error"
    except TPLowerError as e:
        text = str(e)
    except Exception as e:  # the refusal this file asks for is a TPLowerError: anything else fails the test
        text = f"{type(e).__name__}: {e}"
    return {"error": text, "collectives": _issued() - before}


def _without_context(mesh: Any) -> dict[str, Any]:
    """A shard_sequence part given to a model parallelized with the tp plan but no context (context forgotten);
    and parallelize with nothing to do."""
    ref = tiny("llama", "sdpa")
    part = tplower.shard_sequence(batch("plain", 20), mesh)
    model = tplower.parallelize(copy.deepcopy(ref), mesh, "auto")
    return {"part": _refused(lambda: model(**part)),
            "nothing": _refused(lambda: tplower.parallelize(copy.deepcopy(ref), mesh, None))}


def _gathered(mesh: Any) -> dict[str, Any]:
    """Logits cut with balance=True at an even length (20 tokens, cp=2: 10 a rank either way), made whole with the
    part's split, against one process; a balance= that is not the split's, or one without a split, is refused."""
    ref = tiny("llama", "sdpa")
    model = tplower.parallelize(copy.deepcopy(ref), mesh, None, context="cp")
    whole = batch("plain", 20)
    want = ref(**whole, use_cache=False).logits.detach()
    part = tplower.shard_sequence(whole, mesh, balance=True)
    logits = model(**part).logits.detach()
    before = _issued()
    got = tplower.gather_sequence(logits, mesh, split=part)
    alone = tplower.gather_sequence(logits, mesh, split=part["context_split"])  # the split without its part
    whole_ids = batch("plain", 16)["input_ids"]
    ids = tplower.shard_sequence({"input_ids": whole_ids}, mesh)  # a [2, 8] piece a rank
    before = _issued()
    right = bool(torch.equal(tplower.gather_sequence(ids["input_ids"], mesh, dim=1, split=ids), whole_ids))
    right_collectives = _issued() - before
    return {"diff": float((got - want).abs().max()), "gathered": _issued() - before,
            "split_only": float((alone - want).abs().max()),
            "mismatch": _refused(lambda: tplower.gather_sequence(logits, mesh, balance=False, split=part)),
            # cut with balance=True; at 20 tokens balance=False gives every rank 10 too: only the split can tell
            "balance_alone": _refused(lambda: tplower.gather_sequence(logits, mesh, balance=False)),
            "wrong_dim": _refused(lambda: tplower.gather_sequence(ids["input_ids"], mesh, dim=0, split=ids)),
            "right_dim": (right, right_collectives)}


def _words(mesh: Any, cp_only: Any) -> dict[str, Any]:
    """Unclear refusals made clear: plan "auto" on a mesh without tp, a misspelled mode, a misnamed axis."""
    ref = tiny("llama", "sdpa")
    whole = batch("plain", 20)
    return {"auto": _refused(lambda: tplower.parallelize(copy.deepcopy(ref), cp_only, "auto", context="cp")),
            "mode": _refused(lambda: tplower.parallelize(copy.deepcopy(ref), mesh, None, context="cp",
                                                         context_mode="ulyses")),
            "axis_case": _refused(lambda: tplower.parallelize(copy.deepcopy(ref), mesh, None, context="CP")),
            "loss_chunk": _refused(lambda: tplower.parallelize(copy.deepcopy(ref), mesh, None, context="cp",
                                                               context_loss_chunk="8")),
            "experts": _refused(lambda: tplower.parallelize(copy.deepcopy(ref), mesh, "auto", experts="eps")),
            "cover": _refused(lambda: tplower.parallelize(copy.deepcopy(ref), mesh, "auto", cover="refuce")),
            "axis_seq": _refused(lambda: tplower.shard_sequence(whole, mesh, "seq"))}


def _vocab_labels(mesh: Any) -> dict[str, Any]:
    """labels given to a cp x tp model whose lm_head leaves the logits sharded on the vocabulary over tp."""
    from tplower.plans.hf import model_tp_plan

    ref = tiny("llama", "sdpa")
    model = tplower.parallelize(copy.deepcopy(ref), mesh, {**model_tp_plan(ref), "lm_head": "colwise"}, context="cp")
    part = tplower.shard_sequence(batch("padded", 20), mesh)
    return _refused(lambda: model(**part))


def _own_config(mesh: Any) -> dict[str, Any]:
    """A model built from a config, parallelized with context="cp": the config object left as it was, and a second
    model built from it afterwards runs as one process (it was told it runs as 'tplower_context')."""
    from transformers import LlamaForCausalLM

    user = tiny("llama", "sdpa")
    config = user.config  # the caller's config object, held by the model's modules
    want = copy.deepcopy(user)  # one process, with its own copy
    before, held = config.to_dict(), sum(getattr(m, "config", None) is config for m in user.modules())
    model = tplower.parallelize(user, mesh, None, context="cp")
    whole = batch("padded", 20)
    loss = model(**tplower.shard_sequence(whole, mesh)).loss
    with _SEEDED:
        second = LlamaForCausalLM(config)
    second.load_state_dict(want.state_dict())
    logits = second(**whole, use_cache=False).logits
    return {"unchanged": config.to_dict() == before and config._attn_implementation == "sdpa", "held": held,
            "still_held": sum(getattr(m, "config", None) is config for m in model.modules()),
            "installed": model.config._attn_implementation,
            "loss": float((loss - want(**whole, use_cache=False).loss).abs().detach()),
            "second": float((logits - want(**whole, use_cache=False).logits).abs().max().detach())}


def _case(run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``run(*args)``, or ``{"crashed": the error}`` (alike on every rank), so one case's failure is its test's."""
    try:
        return run(*args)
    except Exception as e:
        return {"crashed": f"{type(e).__name__}: {e}"}


def _body(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    cp_only = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    return {"without_context": _case(_without_context, mesh), "gathered": _case(_gathered, mesh),
            "words": _case(_words, mesh, cp_only), "vocab_labels": _case(_vocab_labels, mesh),
            "own_config": _case(_own_config, cp_only)}


def _packed(rank: int, world: int) -> dict[str, Any]:
    """Packed documents with and without a KV cache: one process's logits both ways, and what a model parallelized
    without context says when called with each."""
    ref = tiny("llama", "sdpa")
    whole = batch("packed", 20)
    ids, positions = whole["input_ids"], whole["position_ids"]
    with torch.no_grad():
        cached = ref(input_ids=ids, position_ids=positions).logits  # the config's default: use_cache=True
        fresh = ref(input_ids=ids, position_ids=positions, use_cache=False).logits
    model = tplower.parallelize(copy.deepcopy(ref), init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)), "auto")
    said = {}
    for name, kwargs in (("cached", {}), ("fresh", {"use_cache": False})):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model(input_ids=ids, position_ids=positions, **kwargs)
        said[name] = [str(w.message) for w in seen if "tplower" in str(w.message)]
    return {"apart": float((cached - fresh).abs().max()), "said": said}


@pytest.fixture(scope="module")
def ranks(_counted: None) -> list[dict[str, Any]]:
    tiny("llama", "sdpa")  # transformers' lazy imports once, outside the threads
    out: list[dict[str, Any]] = run_threaded(4, _body, timeout=300)
    return out


def _check(got: dict[str, Any], *words: str) -> None:
    assert got.get("collectives") == 0, got  # refused before any collective
    assert all(w in got["error"] for w in words), got


def test_a_sharded_part_given_to_a_model_without_context_is_refused(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert "crashed" not in r["without_context"], r["without_context"]
        _check(r["without_context"]["part"], "without context parallelism", "context='cp'",
               "tplower.parallelize(model, mesh, plan, context='cp')")


def test_parallelize_with_nothing_to_do_is_refused(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert "crashed" not in r["without_context"], r["without_context"]
        _check(r["without_context"]["nothing"], "plan=None and context=None: nothing to parallelize", "context='cp'")


def test_gather_reads_the_balance_from_the_split(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        got = r["gathered"]
        assert "crashed" not in got, got
        assert got["diff"] <= TOL and got["split_only"] <= TOL, got  # one process's token order
        assert got["gathered"] > 0, got  # the counter sees this rank's collectives
        _check(got["mismatch"], "balance=False", "balance=True", "drop balance=")
        _check(got["balance_alone"], "balance=False without split=", "pass split=")


def test_gather_refuses_a_dim_that_is_not_the_split_sequence(ranks: list[dict[str, Any]]) -> None:
    """A [2, 8] piece gathered on dim 0 (the batch): each rank's 8 tokens are its local length, dim 0's size 2 is
    not; every rank raises alike, after the sizes' exchange and before the data moves (fewer collectives than the
    right gather, on dim 1, which gives the whole ids back)."""
    for r in ranks:
        got = r["gathered"]["wrong_dim"]
        assert got["error"] == ("gather_sequence: dim=0 of t (shape [2, 8]) has 2 entries on this rank, but the "
                                "split gives this rank 8 tokens (dim 0's sizes by rank: [2, 2]; the split's local "
                                "lengths: [8, 8]); pass the sequence dim of t; did you mean dim=1?"), got
        right, collectives = r["gathered"]["right_dim"]
        assert right and 0 < got["collectives"] < collectives, (got, collectives)
        assert got["collectives"] == ranks[0]["gathered"]["wrong_dim"]["collectives"]


def _words_of(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for r in ranks:
        assert "crashed" not in r["words"], r["words"]
    return [r["words"] for r in ranks]


def test_plan_auto_on_a_mesh_without_tp_names_plan_none(ranks: list[dict[str, Any]]) -> None:
    for words in _words_of(ranks):
        _check(words["auto"], "the mesh has no 'tp' axis", "use plan=None for context parallelism alone",
               "add a 'tp' axis")


def test_a_misspelled_context_mode_gets_the_closest(ranks: list[dict[str, Any]]) -> None:
    for words in _words_of(ranks):
        _check(words["mode"], "context_mode='ulyses'", "did you mean 'ulysses'?")


def test_a_misnamed_context_axis_gets_the_closest(ranks: list[dict[str, Any]]) -> None:
    for words in _words_of(ranks):
        _check(words["axis_case"], "context='CP'", "did you mean 'cp'?")
        _check(words["axis_seq"], "axis='seq'", "did you mean 'cp'?")
        assert "make the mesh with" not in words["axis_case"]["error"] + words["axis_seq"]["error"], words


def test_parallelize_names_its_own_arguments(ranks: list[dict[str, Any]]) -> None:
    """context_loss_chunk by parallelize's name (it said install_context: loss_chunk); experts and cover refused as
    every other argument is, a TPLowerError (a ValueError too) with the closest choice."""
    assert issubclass(TPLowerError, ValueError)
    for words in _words_of(ranks):
        _check(words["loss_chunk"], "parallelize: context_loss_chunk='8' must be an int >= 1")
        _check(words["experts"], "parallelize: experts='eps' (did you mean 'ep'?); allowed: 'tp'")
        _check(words["cover"], "parallelize: cover='refuce' (did you mean 'refuse'?); allowed: 'reduce', 'refuse'")
        assert "install_context" not in words["loss_chunk"]["error"], words


def test_the_callers_config_is_left_as_it_was(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        got = r["own_config"]
        assert "crashed" not in got, got
        assert got["unchanged"] and got["held"] > 0 and got["still_held"] == 0, got
        assert got["installed"] == "tplower_context", got
        assert got["loss"] <= TOL and got["second"] <= TOL, got


def test_every_module_gets_the_config_copy_and_its_sub_configs() -> None:
    """A composite model (Llava: a CLIP vision tower beside a Llama text model): every module that held the config,
    its text config or its vision config holds the copy's counterpart; changing the copy's text config leaves the
    caller's configs as they were."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, PretrainedConfig

    from tplower.context.discover import own_config
    from tplower.run.hf_configs import tiny_config

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=8, patch_size=4)
    config = LlavaConfig(vision_config=vision, text_config=tiny_config("llama"), image_token_index=5)
    model = LlavaForConditionalGeneration(config)
    originals = {id(config): "", id(config.text_config): "text_config", id(config.vision_config): "vision_config"}
    held = [(m, k, originals[id(v)]) for m in model.modules() for k, v in vars(m).items()
            if isinstance(v, PretrainedConfig)]
    assert {part for _, _, part in held} == {"", "text_config", "vision_config"}  # the case is what it claims
    own_config(model)
    for m, k, part in held:
        assert getattr(m, k) is (getattr(model.config, part) if part else model.config), (type(m).__name__, k)
    assert id(model.config) not in originals and id(model.config.text_config) not in originals
    model.config.text_config._attn_implementation = "eager"
    assert (config.text_config._attn_implementation, config._attn_implementation) == ("sdpa", "sdpa")
    assert model.config.to_dict()["text_config"]["hidden_size"] == config.text_config.hidden_size


def test_labels_with_vocabulary_sharded_logits_point_at_the_vocab_parallel_loss(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        _check(r["vocab_labels"], "'lm_head' sharded over 'tp'", "tplower.vocab_parallel_cross_entropy(",
               "context='cp'", "colwise_gather_output")


def test_packed_documents_with_a_cache_are_warned_of() -> None:
    tiny("llama", "sdpa")
    [got] = run_threaded(1, _packed, timeout=120)
    assert got["apart"] > 0.1, got  # one process with its default cache attends across the documents
    assert len(got["said"]["cached"]) == 1 and "use_cache=False" in got["said"]["cached"][0], got
    assert got["said"]["fresh"] == [], got
    assert "use_cache=False" in DOCS.read_text() and "`use_cache=True`" in DOCS.read_text()


def _section(doc: str, name: str) -> str:
    """The text of argument ``name`` in a Google-style docstring's Args (up to the next argument)."""
    found = re.search(rf"\n {{8}}{name}: (.*?)(?=\n {{8}}\w+(?:, \w+)*: |\n\n)", doc, re.S)
    assert found, name
    return found.group(1)


def test_parallelize_docstring_puts_plan_none_under_plan_and_quotes_the_measured_figures() -> None:
    doc = inspect.getdoc(tplower.parallelize)
    assert doc is not None
    doc = "\n    " + doc.replace("\n", "\n    ")  # the indentation the section pattern reads
    assert "``None``" in _section(doc, "plan") and "``None``" not in _section(doc, "axis")
    # the context_mode figures are the table's in docs/context.md (8192 tokens, cp=2, plain: step and peak memory
    # per one process)
    rows = {m: re.search(rf"\| 8192 \| 2 \| {m} \| plain \| \d+ \| ([\d.]+) \([\d.-]+\) \| [^|]+ \| [\d.]+ \| "
                         r"([\d.]+) \|", DOCS.read_text()) for m in ("ulysses", "allgather")}
    table = {m: (row.group(1), row.group(2)) for m, row in rows.items() if row}
    assert len(table) == 2
    figures = re.findall(r"(\d\.\d\d)x", _section(doc, "context_mode"))
    assert figures == [*table["ulysses"], *table["allgather"]], (figures, table)


def test_verify_takes_plan_none() -> None:
    hints = typing.get_type_hints(tplower.verify)
    assert type(None) in typing.get_args(hints["plan"])
