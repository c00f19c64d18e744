"""Mixture-of-experts models under ``parallelize(model, mesh, "auto")``: tensor parallelism inside the experts.

Each architecture is built tiny and random (:mod:`tplower.run.hf_table`), run at tp=2 on 2 gloo processes in
training mode, and checked against the same model in one process: the logits, every parameter's gradient
(the full value of a sharded one), the replicated gradients equal on both ranks, and one SGD step leaving the
replicated parameters equal on both ranks. The set covers the forms transformers' plans take: packed
``[experts, gate; up, hidden]`` weights (``packed_colwise``) with ``rowwise`` down projections (Qwen3-MoE,
Mixtral), a shared expert and grouped routing (DeepSeek-V3), transposed expert weights with ``packed_rowwise``
and experts that take tokens already scaled by the router (Llama 4), a plan that says ``colwise`` for a
concatenated gate/up weight (Inkling 2), gpt-oss (whose plan shards only the embedding) and identity (zero)
experts among the tensor-parallel ones (LongCat-Flash: ``moe_identity_expert``). transformers 5.25 dropped the
experts' entries of Inkling, Inkling 2 and LongCat-Flash from their plans: those three take 5.24's entries over
their own plan (:data:`EXPERT_ENTRIES`), so the forms stay checked on either release.
"""

from __future__ import annotations

import copy
import hashlib
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import tplower
from tplower import TPLowerError, parse_placement
from tplower.plans.entries import load_plan, resolve_entry
from tplower.plans.hf import model_tp_plan, param_key_placement
from tplower.run.hf_table import architectures, input_ids, tiny_config, tiny_model
from tplower.testing import run_processes, run_threaded

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3", "llama4_text", "inkling2_text", "gpt_oss", "longcat_flash")
EP_ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")  # gpt-oss: expert biases sharded by expert too
REFUSED = {"inkling_text": "no input is declared"}
LOGIT_TOL, GRAD_RTOL = 1e-5, 1e-4
_X, _SHARED = "model.layers.*.mlp.experts", "model.layers.*.mlp.shared_experts"
#: the experts' entries of the plans transformers 5.24 ships for these models, merged over the model's own plan:
#: 5.25 dropped them (its "auto" leaves those experts whole), and the forms they take stay checked either way
EXPERT_ENTRIES = {
    "inkling_text": {f"{_X}.gate_up_proj": "colwise", f"{_X}.down_proj": "rowwise", _X: "moe_tp_experts",
                     f"{_SHARED}.gate_proj": "colwise", f"{_SHARED}.up_proj": "colwise",
                     f"{_SHARED}.down_proj": "rowwise", _SHARED: "all_reduce"},
    "inkling2_text": {f"{_X}.gate_up_proj": "colwise", f"{_X}.down_proj": "rowwise", _X: "moe_tp_experts"},
    "longcat_flash": {f"{_X}.gate_up_proj": "packed_colwise", f"{_X}.down_proj": "rowwise",
                      f"{_X}.identity_expert": "moe_identity_expert", _X: "moe_tp_experts"},
}


def _plan(model_type: str, model: nn.Module, experts: str = "tp") -> Any:
    """``"auto"``, or for :data:`EXPERT_ENTRIES`' models under tensor parallelism the model's plan with them."""
    if experts != "tp" or model_type not in EXPERT_ENTRIES:
        return "auto"
    names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]  # keys name either
    # LongCat-Flash's identity experts are a module of the experts in 5.24; 5.25 adds them outside (no key then)
    kept = {k: v for k, v in EXPERT_ENTRIES[model_type].items()
            if any(re.fullmatch(re.escape(k).replace(r"\*", "[^.]+"), n) for n in names)}
    return {**model_tp_plan(model), **kept}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _digest(t: torch.Tensor) -> str:
    """The exact bytes of a local tensor, hashed (tensors do not travel back from the ranks)."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return hashlib.sha256(local.detach().contiguous().numpy().tobytes()).hexdigest()


def _replicated(p: torch.Tensor) -> bool:
    return not isinstance(p, DTensor) or all(q.is_replicate() for q in p.placements)


def _one(model_type: str, mesh: Any, experts: str = "tp") -> dict[str, Any]:
    ref = tiny_model(architectures([model_type])[0]).train()
    ids = input_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = tplower.parallelize(copy.deepcopy(ref), mesh, _plan(model_type, ref, experts), experts=experts)
    want = ref(input_ids=ids, use_cache=False).logits
    want.square().mean().backward()
    got = tp(input_ids=ids, use_cache=False).logits
    got.square().mean().backward()
    worst, sharded, by_expert = 0.0, 0, 0
    for (name, p), (_, q) in zip(ref.named_parameters(), tp.named_parameters(), strict=True):
        if p.grad is None:
            assert q.grad is None, name
            continue
        assert q.grad is not None, f"{name}: no gradient under tplower"
        sharded += not _replicated(q)
        by_expert += isinstance(q, DTensor) and "experts" in name and q.placements[0] == Shard(0)
        scale = max(float(p.grad.abs().max()), 1e-6)  # a gradient of 1e-12 (a router at init) is rounding
        worst = max(worst, float((_full(q.grad) - p.grad).abs().max()) / scale)
    rep_grads = {n: _digest(q.grad) for n, q in tp.named_parameters() if q.grad is not None and _replicated(q)}
    torch.optim.SGD(tp.parameters(), lr=0.1).step()
    rep_after = {n: _digest(q) for n, q in tp.named_parameters() if _replicated(q)}
    return {"logits": float((got - want).detach().abs().max()), "grad_rel": worst, "sharded": sharded,
            "by_expert": by_expert,
            "rep_grads": rep_grads, "rep_after": rep_after}


def _refusal(model_type: str, mesh: Any) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tiny_model(architectures([model_type])[0])
            tplower.parallelize(model, mesh, _plan(model_type, model))
    except TPLowerError as exc:
        return str(exc)
    return "not refused"


def _ep_refusals(mesh: Any) -> list[str]:
    import transformers

    config = tiny_config("qwen3_moe")
    config.num_experts = 3  # does not divide over 2 ranks
    odd = transformers.Qwen3MoeForCausalLM(config)
    msgs = []
    for model, kw in ((odd, {"experts": "ep"}), (tiny_model(architectures(["llama4_text"])[0]), {"experts": "ep"}),
                      (odd, {"experts": "expert"})):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tplower.parallelize(model, mesh, "auto", **kw)
            msgs.append("not refused")
        except (TPLowerError, ValueError) as exc:
            msgs.append(str(exc))
    return msgs


def _codegen(model_type: str, mesh: Any, experts: str) -> dict[str, Any]:
    """Generated forwards (tplower codegen) against the hooks: logits and every local gradient, bit for bit."""
    from tplower.codegen.emit import emit, install

    ref = tiny_model(architectures([model_type])[0]).train()
    ids = input_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = _plan(model_type, ref, experts)
        source = emit(ref, mesh, plan, experts=experts)
        hooked = tplower.parallelize(copy.deepcopy(ref), mesh, plan, experts=experts)
        written = install(copy.deepcopy(ref), mesh, source)
    a, b = (m(input_ids=ids, use_cache=False).logits for m in (hooked, written))
    a.square().mean().backward()
    b.square().mean().backward()
    same = all(_digest(p.grad) == _digest(q.grad) for p, q in zip(hooked.parameters(), written.parameters(),
                                                                   strict=True) if p.grad is not None)
    return {"logits_equal": bool(torch.equal(a, b)), "grads_equal": same, "source": source if mesh.get_rank() == 0
            else "", "identity_modules": sum(n.endswith("identity_expert") for n, _ in ref.named_modules())}


def _stack(model_type: str, mesh: Any, experts: str) -> dict[str, Any]:
    """What a training script does next, against one process: clip_grad_norm_, 3 AdamW (foreach) steps,
    activation checkpointing, greedy generate() with the KV cache."""
    ref = tiny_model(architectures([model_type])[0]).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = tplower.parallelize(copy.deepcopy(ref), mesh, "auto", experts=experts)
    out: dict[str, Any] = {"all_dtensor": all(isinstance(p, DTensor) for p in tp.parameters())}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for m in (ref, tp)]
    norms: list[list[float]] = [[], []]
    for step in range(3):
        ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(step))  # routing differs
        for i, (m, opt) in enumerate(zip((ref, tp), opts, strict=True)):
            opt.zero_grad()
            m(input_ids=ids, use_cache=False).logits.square().mean().backward()
            norms[i].append(float(_full(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05))))
            opt.step()
    out["clip"] = max(abs(a - b) / a for a, b in zip(*norms, strict=True))
    out["adamw"] = max(float((_full(q) - p).abs().max()) for p, q in zip(ref.parameters(), tp.parameters(),
                                                                         strict=True))
    out["rep_after"] = {n: _digest(q) for n, q in tp.named_parameters() if _replicated(q)}
    ref.eval()
    tp.eval()
    ids = input_ids()
    out["generate"] = bool(torch.equal(ref.generate(ids, max_new_tokens=4, do_sample=False),
                                       tp.generate(ids, max_new_tokens=4, do_sample=False)))
    ref.train()
    tp.train()
    tp.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for m in (ref, tp):
        m.zero_grad()
        m(input_ids=ids, use_cache=False).logits.square().mean().backward()
    out["checkpointing"] = max(float((_full(q.grad) - p.grad).abs().max()) / max(float(p.grad.abs().max()), 1e-6)
                               for p, q in zip(ref.parameters(), tp.parameters(), strict=True) if p.grad is not None)
    return out


def _verify_ep(mesh: Any) -> dict[str, Any]:
    """tplower.verify of the expert-parallel plan: every boundary, the experts module's among them."""
    ref = tiny_model(architectures(["qwen3_moe"])[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = tplower.verify(lambda: copy.deepcopy(ref), "auto", mesh, example_inputs(), steps=2, experts="ep")
    experts = [b for b in report.to_dict()["boundaries"] if b["module"] == "model.layers.0.mlp.experts"]
    return {"ok": report.ok, "experts_ok": bool(experts) and experts[0]["ok"]}


def _body(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {m: _one(m, mesh) for m in ARCHS}
    out["stack:tp"] = _stack("qwen3_moe", mesh, "tp")
    out["stack:ep"] = _stack("qwen3_moe", mesh, "ep")
    out["codegen:ep"] = _codegen("qwen3_moe", mesh, "ep")
    out["verify:ep"] = _verify_ep(mesh)
    out["codegen:identity"] = _codegen("longcat_flash", mesh, "tp")
    out.update({f"ep:{m}": _one(m, mesh, "ep") for m in EP_ARCHS})
    out.update({m: _refusal(m, mesh) for m in REFUSED})
    out["ep_refusals"] = _ep_refusals(mesh)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_processes(2, _body, timeout=900)


@pytest.mark.parametrize("model_type", [*ARCHS, *(f"ep:{m}" for m in EP_ARCHS)])
def test_moe_auto_plan_matches_one_process_forward_and_every_gradient(ranks: list[dict[str, Any]],
                                                                      model_type: str) -> None:
    """``ep:NAME``: the same under ``experts="ep"`` (experts sharded by index, tokens dispatched)."""
    r0, r1 = (r[model_type] for r in ranks)
    for r in (r0, r1):
        assert r["logits"] <= LOGIT_TOL, r["logits"]
        assert r["grad_rel"] <= GRAD_RTOL, r["grad_rel"]
    if model_type.startswith("ep:"):
        assert r0["by_expert"] >= 4  # gate_up and down of 2 layers: DTensors sharded on the expert dim
    elif model_type != "gpt_oss":  # gpt-oss's tensor-parallel plan shards the embedding only
        assert r0["sharded"] >= 4  # expert weights of 2 layers are DTensors sharded over tp
    assert r0["rep_grads"].keys() == r1["rep_grads"].keys()
    for name, g in r0["rep_grads"].items():  # a replicated parameter's gradient is whole on every rank
        assert g == r1["rep_grads"][name], name
    for name, p in r0["rep_after"].items():
        assert p == r1["rep_after"][name], name


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_moe_forms_not_lowered_are_refused_with_the_reason(ranks: list[dict[str, Any]], model_type: str) -> None:
    assert REFUSED[model_type] in ranks[0][model_type]


def test_expert_parallel_refusals_name_the_fix(ranks: list[dict[str, Any]]) -> None:
    odd, no_plan, bad = ranks[0]["ep_refusals"]
    assert "3 experts do not divide over the 2 ranks of axis 'tp'" in odd and "experts='tp'" in odd
    assert "no ep_plan" in no_plan and "Llama4ForCausalLM" in no_plan
    assert "experts='expert'" in bad and "'tp'" in bad and "'ep'" in bad


# transformers' shard_param rules for a key that names one parameter (tensor_parallel.py, 5.x), by hand
PARAM_TABLE = [
    ("packed_colwise", "gate_up_proj", 3, ({"tp": "S(1)"}, None, 2)),  # [E, gate; up, H]: each half on its own
    ("packed_colwise", "gate_up_proj_bias", 1, ({"tp": "S(-1)"}, None, 1)),
    ("packed_rowwise", "gate_up_proj", 3, ({"tp": "S(-1)"}, None, 2)),  # transposed [E, H, gate; up]
    ("packed_rowwise", "bias", 1, ({"tp": "R"}, None, 1)),
    ("colwise", "down_proj", 3, ({"tp": "S(1)"}, None, 1)),  # transposed [E, I, H]
    ("rowwise", "down_proj", 3, ({"tp": "S(-1)"}, None, 1)),  # [E, H, I]
    ("replicated_with_grad_allreduce", "weight", 1, ({"tp": "R"}, {"tp": "P(sum)"}, 1)),
    ("grouped_gemm", "gate_up_proj", 3, ({"tp": "S(0)"}, None, 1)),  # expert parallelism: by expert
    ("grouped_gemm", "down_proj_bias", 2, ({"tp": "S(0)"}, None, 1)),
]


@pytest.mark.parametrize("style,name,ndim,want", PARAM_TABLE, ids=[f"{s}-{n}-{d}d" for s, n, d, _ in PARAM_TABLE])
def test_parameter_key_placements(style: str, name: str, ndim: int, want: tuple[Any, ...]) -> None:
    place, grad, parts = want  # the table writes placements as text; the function gives them read
    read = ({"tp": parse_placement(place["tp"])}, None if grad is None else {"tp": parse_placement(grad["tp"])}, parts)
    assert param_key_placement(style, name, ndim, "tp", "here") == read


def test_moe_styles_in_plans() -> None:
    assert load_plan({"layers.*.experts.gate_up_proj": "packed_rowwise"})  # a parameter key: checked at install
    with pytest.raises(TPLowerError, match="name the packed expert weight by its own key"):
        resolve_entry("packed_rowwise", "layers.0.experts", kind="other")
    with pytest.raises(TPLowerError, match="name the expert weight by its own key"):
        resolve_entry("grouped_gemm", "layers.0.experts", kind="other")
    with pytest.raises(TPLowerError, match="a parameter key takes one of"):
        param_key_placement("moe_tp_experts", "w", 3, "tp", "here")


class _Experts(nn.Module):
    """Two experts as 3-D weights, concatenated gate/up as transformers' experts hold them."""

    is_concatenated, has_gate, is_transposed = True, True, False

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.gate_up_proj = nn.Parameter(torch.randn(2, 8, 4, generator=g))
        self.down_proj = nn.Parameter(torch.randn(2, 4, 4, generator=g))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = torch.einsum("th,eih->tei", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("tei,ehi->teh", nn.functional.silu(gate) * up, self.down_proj)
        pick = y.gather(1, ids[..., None].expand(-1, -1, y.shape[-1]))
        return (pick * (w[..., None] if w is not None else 1)).sum(1)


class _WithIdentity(_Experts):
    """The two experts and a third that is the identity (a zero-compute expert, as LongCat-Flash's)."""

    def __init__(self) -> None:
        super().__init__()
        self.identity_expert = nn.Identity()

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = torch.einsum("th,eih->tei", x, self.gate_up_proj).chunk(2, dim=-1)
        y = torch.einsum("tei,ehi->teh", nn.functional.silu(gate) * up, self.down_proj)
        y = torch.cat([y, self.identity_expert(x)[:, None]], dim=1)  # expert 2 returns its tokens
        pick = y.gather(1, ids[..., None].expand(-1, -1, y.shape[-1]))
        return (pick * (w[..., None] if w is not None else 1)).sum(1)


class _Block(nn.Module):
    def __init__(self, identity: bool = False) -> None:
        super().__init__()
        self.experts = _WithIdentity() if identity else _Experts()

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.experts(x, ids, w)


def _synthetic(rank: int, world: int, plan: dict[str, Any], identity: bool = False) -> dict[str, float] | str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref = _Block(identity)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 4, generator=g).requires_grad_(), torch.rand(5, 2, generator=g).requires_grad_()
    ids = torch.randint(0, 3 if identity else 2, (5, 2), generator=g)
    if identity:
        ids[0] = torch.tensor([2, 0])  # the identity expert is picked at least once
    try:
        tp = tplower.parallelize(copy.deepcopy(ref), mesh, plan)
    except TPLowerError as exc:
        return str(exc)
    ref(x, ids, w).square().sum().backward()
    want = (x.grad.clone(), w.grad.clone(), ref.experts.gate_up_proj.grad.clone())  # type: ignore[union-attr]
    x.grad = w.grad = None
    tp(x, ids, w).square().sum().backward()
    got = (x.grad, w.grad, _full(tp.experts.gate_up_proj.grad))
    rel = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want, strict=True)]  # type: ignore[operator]
    return {"dx": rel[0], "dw": rel[1], "dgate_up": rel[2]}


def test_concatenated_gate_up_under_colwise_is_packed_and_input_gradients_reduced() -> None:
    # transformers' plan for some experts says 'colwise' for the concatenated [gate; up] weight: sharded on its
    # own, each rank would hold only gates or only ups. tplower shards each half and says so.
    plan = {"experts": "moe_tp_experts", "experts.gate_up_proj": "colwise", "experts.down_proj": "rowwise"}
    with pytest.warns(UserWarning, match=r"concatenated \[gate; up\] weight with 'colwise'"):
        results = run_threaded(2, _synthetic, plan)
    for res in results:
        assert isinstance(res, dict), res
        assert res["dx"] < 1e-5 and res["dw"] < 1e-5 and res["dgate_up"] < 1e-5, res


def test_moe_tp_experts_without_sharded_expert_weights_is_refused() -> None:
    for res in run_threaded(2, _synthetic, {"experts": "moe_tp_experts"}):
        assert isinstance(res, str) and "no expert weight of the module is sharded" in res, res


def test_expert_weights_split_without_a_reduction_are_refused() -> None:
    plan = {"experts.gate_up_proj": "packed_colwise", "experts.down_proj": "rowwise"}  # no moe_tp_experts
    for res in run_threaded(2, _synthetic, plan):
        assert isinstance(res, str) and "split inside each expert" in res and "'moe_tp_experts'" in res, res


def test_sharded_own_parameters_with_undeclared_inputs_are_refused() -> None:
    plan = {"experts": "all_reduce", "experts.gate_up_proj": "packed_colwise", "experts.down_proj": "rowwise"}
    for res in run_threaded(2, _synthetic, plan):
        assert isinstance(res, str) and "no input is declared" in res and "gate_up_proj" in res, res


IDENTITY_PLAN = {"experts": "moe_tp_experts", "experts.gate_up_proj": "packed_colwise",
                 "experts.down_proj": "rowwise", "experts.identity_expert": "moe_identity_expert"}


def test_identity_expert_gives_its_share_forward_and_backward() -> None:
    for res in run_threaded(2, _synthetic, IDENTITY_PLAN, True):
        assert isinstance(res, dict), res
        assert res["dx"] < 1e-5 and res["dw"] < 1e-5 and res["dgate_up"] < 1e-5, res
    # without it the block's one reduction counts the identity expert's tokens once per rank
    plan = {k: v for k, v in IDENTITY_PLAN.items() if k != "experts.identity_expert"}
    for res in run_threaded(2, _synthetic, plan, True):
        assert isinstance(res, dict) and res["dx"] > 1e-2, res


def test_codegen_writes_the_dispatch_and_the_identity_share_out(ranks: list[dict[str, Any]]) -> None:
    for key in ("codegen:ep", "codegen:identity"):
        for r in ranks:
            assert r[key]["logits_equal"] and r[key]["grads_equal"], key
    ep, identity = ranks[0]["codegen:ep"]["source"], ranks[0]["codegen:identity"]["source"]
    assert "route = ops.expert_route(self, top_k_index)" in ep and "ops.combine_tokens(out, route" in ep
    assert "ops.hooked(" not in ep and "ops.hooked(" not in identity  # every boundary written out
    if ranks[0]["codegen:identity"]["identity_modules"]:  # transformers 5.24's LongCat-Flash (5.25 adds them outside)
        assert "out = out / 2  # share" in identity or "outs[0] = outs[0] / 2  # share" in identity


def test_identity_share_in_explain() -> None:
    from tplower.plans.forms import explain_plan_lines

    lines = explain_plan_lines({"experts.identity_expert": "moe_identity_expert"}, ["tp"])
    assert lines == ["experts.identity_expert: identity", "  out: tp 1/n share of a sum ==> divide, forward and "
                     "backward"]


# ---- the command line: --experts of verify and codegen -------------------------------------------------------------

def qwen3_moe_model() -> nn.Module:
    """A ``--module`` factory: the tiny random Qwen3-MoE of the architecture table."""
    return tiny_model(architectures(["qwen3_moe"])[0])


def example_inputs() -> dict[str, Any]:
    """What ``tplower verify --module test_moe_tp:...`` feeds the model."""
    return {"input_ids": input_ids(), "use_cache": False}


def _cli(*argv: str) -> tuple[int, str]:
    import contextlib
    import io
    import sys
    from pathlib import Path

    from tplower.cli import main

    out = io.StringIO()
    tests_dir = str(Path(__file__).parent)
    sys.path.insert(0, tests_dir)  # the ranks import test_moe_tp (spawn copies sys.path)
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rc = main([*argv, "--module", "test_moe_tp:qwen3_moe_model", "--plan", "auto", "--experts", "ep"])
    finally:
        sys.path.remove(tests_dir)
    return rc, out.getvalue()


def test_verify_of_the_expert_parallel_plan(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["verify:ep"] == {"ok": True, "experts_ok": True}


def test_cli_codegen_takes_experts() -> None:
    rc, source = _cli("codegen")
    assert rc == 0 and "route = ops.expert_route(self, top_k_index)" in source


@pytest.mark.slow  # the API test above runs the same verify in the shared spawn
def test_cli_verify_takes_experts() -> None:
    import json

    rc, text = _cli("verify", "--nproc", "2", "--steps", "2", "--json", "--no-progress")
    report = json.loads(text)
    assert rc == 0 and report["ok"], text
    experts = [b for b in report["boundaries"] if b["module"] == "model.layers.0.mlp.experts"]
    assert experts and experts[0]["ok"]


def test_explain_moe_bytes_by_hand(capsys: pytest.CaptureFixture[str]) -> None:
    from tplower.cli import main
    from tplower.core.language.explain import explain_moe

    # 4 tokens, hidden 2, top-2 of 4 experts, tp=2, float32 (4 B), by hand:
    # tp: all_reduce sends 2(n-1)/n of the tensor: output [4,2] 32 B forward; [4,2] and [4,2] gradients backward
    info = explain_moe(4, 2, 2, 4, 2)
    assert (info["tp"]["forward_bytes_per_rank"], info["tp"]["backward_bytes_per_rank"]) == (32, 64)
    # ep: 2 tokens a rank, 4 slots; counts 4 int64 to the other rank 32 B; each all_to_all half of [4,2] 16 B
    # (4 of them); output all_gather [2,2] 16 B; backward gathers of the [2,2] and [2,2] input gradients 16 B each
    assert (info["ep"]["forward_bytes_per_rank"], info["ep"]["backward_bytes_per_rank"]) == (32 + 32 + 16, 32 + 32)
    assert info["ep"]["worst_step_bytes_per_rank"] == 144 + 4 * 16  # every slot leaves: 32 B per all_to_all
    # 3 experts over 2 ranks: expert parallelism is refused, tensor parallelism inside the experts is the same as
    # for 4 experts (its all_reduces carry the [4,2] output and gradients whatever the expert count)
    odd = explain_moe(4, 2, 2, 3, 2)
    assert not odd["ep"]["possible"] and odd["ep"]["step_bytes_per_rank"] is None
    assert "3 experts do not divide over 2 ranks" in odd["ep"]["refused"] and odd["ep"]["refused"].endswith("1, 3")
    assert odd["tp"]["possible"] and (odd["tp"]["forward_bytes_per_rank"], odd["tp"]["backward_bytes_per_rank"]) == (
        32, 64)
    assert main(["explain", "--moe", "tokens=4,hidden=2,top_k=2,experts=4"]) == 0
    assert "fewer bytes per step: tensor parallelism inside the experts (96 B vs 144 B)" in capsys.readouterr().out
    assert main(["explain", "--moe", "tokens=4,hidden=2"]) == 2
    assert "missing top_k, experts" in capsys.readouterr().err


@pytest.mark.parametrize("experts", ["tp", "ep"])
def test_training_stack_on_a_moe_model(ranks: list[dict[str, Any]], experts: str) -> None:
    """Every parameter a DTensor; clip, AdamW (foreach), checkpointing and generate() as in one process."""
    r0, r1 = (r[f"stack:{experts}"] for r in ranks)
    for r in (r0, r1):
        assert r["all_dtensor"]
        assert r["clip"] <= 1e-5, r["clip"]  # the total norm, relative
        assert r["adamw"] <= 1e-4, r["adamw"]  # after 3 steps of lr 1e-3 (Adam rescales tiny gradients' noise)
        assert r["generate"]
        assert r["checkpointing"] <= GRAD_RTOL, r["checkpointing"]
    assert r0["rep_after"] == r1["rep_after"]  # replicated parameters stay identical on both ranks


def _compiled(rank: int, world: int, experts: str) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ref = tiny_model(architectures(["qwen3_moe"])[0]).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp = tplower.parallelize(copy.deepcopy(ref), mesh, "auto", experts=experts)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(tp, backend="aot_eager")
    diffs = []
    for seed in range(3):  # three steps whose routing differs
        ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(seed))
        got = compiled(input_ids=ids, use_cache=False).logits
        got.square().mean().backward()
        diffs.append(float((got - ref(input_ids=ids, use_cache=False).logits).abs().max()))
    return {"diff": max(diffs), "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values())}


@pytest.mark.slow
def test_compiled_moe_graphs_and_breaks() -> None:
    """torch.compile (aot_eager) over steps whose routing differs: tensor parallelism inside the experts and expert
    parallelism (its counts kept as tensors, its exchange one operator) both trace without a break."""
    for experts in ("tp", "ep"):
        r = run_processes(2, _compiled, experts, timeout=900)[0]
        assert r["diff"] <= LOGIT_TOL and r["breaks"] == 0 and r["graphs"] <= 2, (experts, r)


def _fsdp(rank: int, world: int, ref: nn.Module, ids: torch.Tensor, want: dict[str, torch.Tensor],
          experts: str) -> float:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_coordinate()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model: Any = tplower.parallelize(copy.deepcopy(ref), mesh, "auto", experts=experts)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    model(input_ids=ids.chunk(2, 0)[dp], use_cache=False).logits.square().mean().backward()
    return max(float((_full(p.grad) - want[n] / 2).abs().max()) / max(float(want[n].abs().max()), 1e-6)
               for n, p in model.named_parameters() if n in want)


@pytest.mark.parametrize("experts", ["tp", "ep"])
def test_fsdp2_over_dp_of_a_moe_model_matches_one_process(experts: str) -> None:
    ref = tiny_model(architectures(["qwen3_moe"])[0]).train()
    ids = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(0))
    for half in ids.chunk(2, 0):  # each dp rank's loss; FSDP2 averages their gradients over dp
        ref(input_ids=half, use_cache=False).logits.square().mean().backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    ref.zero_grad(set_to_none=True)
    for worst in run_threaded(4, _fsdp, ref, ids, want, experts, timeout=600):
        assert worst <= GRAD_RTOL, worst
