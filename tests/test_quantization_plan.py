"""Mixed precision by measurement (`hybrid-engine quantize --plan auto`): the planner (a pure
function, by hypothesis), checkpoints mixing int4, int8 and float kinds (they load and run as
their dequantized weights in float32, all three families), the measurement (0 where nothing
is quantized, more for int4 than int8), the written plan within its budget, compressed-tensors'
target rules with several groups, and the command."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors import safe_open

from hybrid_engine.checkpoint_formats.compressed_tensors import target_matches
from hybrid_engine.cli import main as cli_main
from hybrid_engine.kernels.linear.quantized import QuantizedLinearMethod
from hybrid_engine.models.config import CheckpointError
from hybrid_engine.models.linear import Linear
from hybrid_engine.models.loader import map_name
from hybrid_engine.kernels.linear.reference import shard_names
from hybrid_engine.quantization import Quantization
from hybrid_engine.quantization_plan import (FLOAT, PlanError, checkpoint_sizes, choose_plan, kind_of)
from hybrid_engine.quantize_checkpoint import PLAN_KEY, quantized_names, write_checkpoint, write_planned
from hybrid_engine.sensitivity import measure_sensitivity

from quantized_checkpoints import broken_copy, dequantized_copy, greedy_runs, mtp_engine
from spec_models import make_spec_checkpoint

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
WINDOWS = [[(11 * i + 7 * w) % 250 + 1 for i in range(32)] for w in range(2)]


# ---- the planner -------------------------------------------------------------------------------

@st.composite
def kinds(draw):
    """Kinds with bytes (float > int8 > int4) and sensitivities (int4 >= int8 >= 0, ties likely)."""
    n = draw(st.integers(1, 5))
    sizes, sens = {}, {}
    for i in range(n):
        b4 = draw(st.integers(1, 100))
        b8 = b4 + draw(st.integers(1, 100))
        sizes[f"k{i}"] = {4: b4, 8: b8, FLOAT: b8 + draw(st.integers(1, 200))}
        s8 = draw(st.sampled_from([0.0, 0.5, 1.0]))
        sens[f"k{i}"] = {8: s8, 4: s8 + draw(st.sampled_from([0.0, 1.0, 2.5]))}
    return sizes, sens, draw(st.integers(0, 50))


def summed(plan, sens):
    return math.fsum(0.0 if bits is FLOAT else sens[k][bits] for k, bits in plan.items())


def total(plan, sizes, fixed):
    return fixed + sum(sizes[k][bits] for k, bits in plan.items())


@settings(max_examples=300, deadline=None)
@given(kinds(), st.integers(0, 2000), st.integers(0, 500))
def test_plans_fit_and_more_budget_never_costs_more(case, budget, more):
    sizes, sens, fixed = case
    smallest = total({k: 4 for k in sizes}, sizes, fixed)
    if budget < smallest:
        with pytest.raises(PlanError, match=f"below the smallest plan, every kind at int4: {smallest:,} bytes"):
            choose_plan(sizes, sens, fixed, budget)
        return
    plan = choose_plan(sizes, sens, fixed, budget)
    assert total(plan, sizes, fixed) <= budget
    richer = choose_plan(sizes, sens, fixed, budget + more)
    assert total(richer, sizes, fixed) <= budget + more
    assert summed(richer, sens) <= summed(plan, sens)
    # ties: the same plan whatever order the kinds come in
    assert choose_plan(dict(reversed(sizes.items())), dict(reversed(sens.items())), fixed, budget) == plan


@settings(max_examples=100, deadline=None)
@given(kinds(), st.integers(0, 100))
def test_all_float_when_it_fits_and_int4_when_only_that_fits(case, spare):
    sizes, sens, fixed = case
    all_float = total({k: FLOAT for k in sizes}, sizes, fixed)
    assert set(choose_plan(sizes, sens, fixed, all_float + spare).values()) == {FLOAT}
    assert set(choose_plan(sizes, sens, fixed, total({k: 4 for k in sizes}, sizes, fixed)).values()) == {4}


def test_the_budget_goes_where_the_sensitivity_is():
    sizes = {"a": {4: 10, 8: 20, FLOAT: 40}, "b": {4: 10, 8: 20, FLOAT: 40}}
    sens = {"a": {4: 5.0, 8: 0.1}, "b": {4: 1.0, 8: 0.01}}
    assert choose_plan(sizes, sens, 0, 30) == {"a": 8, "b": 4}
    assert choose_plan(sizes, sens, 0, 40) == {"a": 8, "b": 8}
    assert choose_plan(sizes, sens, 0, 60) == {"a": FLOAT, "b": 8}


# ---- checkpoints mixing precisions -------------------------------------------------------------

@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    return make_spec_checkpoint(tmp_path_factory.mktemp(request.param), request.param, embed_scale=1.6)


def mixed_bits(folder) -> dict[str, int]:
    """Every quantizable weight of `folder` by kind in turn: int4, int8, float, int4, ..."""
    names = quantized_names(folder, Quantization("int4", 32))
    kinds = sorted({kind_of(n) for n in names})
    choice = {kind: (4, 8, FLOAT)[i % 3] for i, kind in enumerate(kinds)}
    return {n: choice[kind_of(n)] for n in names if choice[kind_of(n)] is not FLOAT}


def test_mixed_checkpoint_runs_as_its_dequantized_weights(ckpt, tmp_path):
    bits = mixed_bits(ckpt)
    assert set(bits.values()) == {4, 8}
    write_checkpoint(ckpt, tmp_path / "mixed", bits, 32)
    quant = json.loads((tmp_path / "mixed" / "config.json").read_text())["quantization_config"]
    assert [g["weights"]["num_bits"] for g in quant["config_groups"].values()] == [4, 8]
    stored = mtp_engine(tmp_path / "mixed", "torch")
    for name, layer in stored.model.named_modules():
        if isinstance(layer, Linear):                  # each layer in its weights' bits, float where none
            want = {bits.get(f"{base}.weight") for base, _ in shard_names(layer, name)} - {None}
            got = {layer.method.bits} if isinstance(layer.method, QuantizedLinearMethod) else set()
            assert got == want, name
    dequantized_copy(ckpt, tmp_path / "dequantized", lambda key: bits.get(map_name(key)), 32)
    want = greedy_runs(mtp_engine(tmp_path / "dequantized", "torch"), max_tokens=32)
    got = greedy_runs(stored, max_tokens=32)
    for (w_ids, w_lp), (g_ids, g_lp) in zip(want, got):
        assert g_ids == w_ids
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp), atol=1e-4, rtol=0)


# ---- the measurement and the written plan ------------------------------------------------------

@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_spec_checkpoint(tmp_path_factory.mktemp("dense"), "qwen3_5", embed_scale=1.6)


def test_sensitivity_is_zero_where_nothing_is_quantized(dense, tmp_path):
    names = {n for n in quantized_names(dense, Quantization("int4", 32)) if kind_of(n) == "mlp.down_proj"}
    kl = measure_sensitivity(dense, {"nothing": set(), "mlp.down_proj": names, "mtp": {"mtp.x"}}, WINDOWS, 32, tmp_path)
    assert kl["nothing"] == {4: 0.0, 8: 0.0}
    assert kl["mtp"] == {4: 0.0, 8: 0.0}                  # not in the scored forward, not run
    assert kl["mlp.down_proj"][4] > kl["mlp.down_proj"][8] > 0
    assert not any(tmp_path.iterdir())                    # the copies are gone


def tensor_bytes(folder) -> int:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())


def test_written_plan_respects_its_budget(dense, tmp_path):
    sizes = checkpoint_sizes(dense, quantized_names(dense, Quantization("int4", 32)), 32)
    int4, int8 = (sizes.total(dict.fromkeys(sizes.kinds, b)) for b in (4, 8))
    budget = (int4 + int8) // 2
    plan = write_planned(dense, tmp_path / "mid", budget, WINDOWS, "test windows")
    written = json.loads((tmp_path / "mid" / "config.json").read_text())
    assert written[PLAN_KEY] == plan
    assert plan["total_bytes"] == tensor_bytes(tmp_path / "mid") <= budget
    assert set(plan["kinds"]) == {"attn.o_proj", "attn.qkv", "gdn.in_proj", "gdn.out_proj", "lm_head",
                                  "mlp.down_proj", "mlp.gate_up", "mtp"}
    assert {row["bits"] for row in plan["kinds"].values()} >= {4, 8}
    for kind, row in plan["kinds"].items():
        assert (row["kl_int4"] > row["kl_int8"] > 0) or kind == "mtp", (kind, row)
    assert plan["calibration"] == "test windows" and plan["max_bytes"] == budget and plan["not_run"] == ["mtp"]
    assert greedy_runs(mtp_engine(tmp_path / "mid"))                       # it loads and runs

    tight = write_planned(dense, tmp_path / "tight", int4, WINDOWS, "test windows")
    assert {row["bits"] for row in tight["kinds"].values()} == {4} and tight["total_bytes"] == int4
    generous = write_planned(dense, tmp_path / "float", sizes.total(dict.fromkeys(sizes.kinds, FLOAT)), WINDOWS, "t")
    assert {row["bits"] for row in generous["kinds"].values()} == {FLOAT}
    float_config = json.loads((tmp_path / "float" / "config.json").read_text())
    assert "quantization_config" not in float_config and float_config[PLAN_KEY] == generous
    with pytest.raises(PlanError, match=f"every kind at int4: {int4:,} bytes"):
        write_planned(dense, tmp_path / "none", int4 - 1, WINDOWS, "t")
    assert not (tmp_path / "none").exists()                                # refused before measuring


# ---- several config groups ---------------------------------------------------------------------

def test_targets_follow_compressed_tensors_rules():
    name = "model.layers.0.mlp.down_proj"
    assert target_matches(name, name) and target_matches("Linear", name)
    assert target_matches("re:.*mlp\\.down_proj$", name) and target_matches("re:model\\.layers\\.0", name)
    assert not target_matches("re:layers", name)                           # re.match: from the start
    assert not target_matches("model.layers.0.mlp", name) and not target_matches("Embedding", name)


@pytest.fixture(scope="module")
def mixed_checkpoint(dense, tmp_path_factory):
    dst = tmp_path_factory.mktemp("mixed") / "q"
    write_checkpoint(dense, dst, mixed_bits(dense), 32)
    return dst


OUT = "model.layers.0.linear_attn.out_proj"          # int4 in mixed_bits
K_PROJ = "model.layers.3.self_attn.k_proj"            # int8 there, as its q_proj and v_proj


@pytest.mark.parametrize("edit,message", [
    (lambda q: q["config_groups"]["group_1"]["targets"].append(OUT),
     f"{OUT} is matched by the targets of group_0 and group_1"),
    (lambda q: q["config_groups"]["group_0"]["targets"].remove(OUT), f"no group's targets match {OUT}"),
    (lambda q: q["config_groups"]["group_0"]["targets"].append("re:(["), "is not a regex"),
    (lambda q: (q["config_groups"]["group_1"]["targets"].remove(K_PROJ),
                q["config_groups"]["group_0"]["targets"].append(K_PROJ)),
     "load as one layer layers.3.self_attn.qkv_proj but the checkpoint gives them different schemes"),
])
def test_a_module_in_two_groups_or_none_is_one_error(mixed_checkpoint, tmp_path, edit, message):
    from hybrid_engine import EngineConfig, LLMEngine
    quant = json.loads((mixed_checkpoint / "config.json").read_text())["quantization_config"]
    int4 = quant["config_groups"]["group_0"]
    assert OUT in int4["targets"] and int4["weights"]["num_bits"] == 4
    broken = broken_copy(mixed_checkpoint, tmp_path / "broken", edit)
    with pytest.raises(CheckpointError, match=message):
        LLMEngine(EngineConfig(model=str(broken), dtype="float32"))


def test_regex_targets_load(mixed_checkpoint, tmp_path):
    """Groups written with regexes (as llm-compressor often writes them) load as the listed names do."""
    def by_regex(quant):
        for group in quant["config_groups"].values():
            group["targets"] = ["re:^" + "|".join(t.replace(".", "\\.") for t in group["targets"]) + "$"]
    regex = broken_copy(mixed_checkpoint, tmp_path / "regex", by_regex)
    assert greedy_runs(mtp_engine(regex, "torch")) == greedy_runs(mtp_engine(mixed_checkpoint, "torch"))


# ---- the command -------------------------------------------------------------------------------

def test_quantize_plan_command(tmp_path, capsys):
    from hybrid_engine.default_model import default_model_path
    src = default_model_path()
    sizes = checkpoint_sizes(src, quantized_names(src, Quantization("int4", 32)), 32)
    int4 = sizes.total(dict.fromkeys(sizes.kinds, 4))
    assert cli_main(["quantize", str(src), str(tmp_path / "q"), "--plan", "auto", "--max-bytes", str(int4 - 1),
                     "--calibration-windows", "1", "--calibration-ctx", "64"]) == 2
    assert f"every kind at int4: {int4:,} bytes" in capsys.readouterr().err
    budget = f"{math.ceil(int4 / 1e3) + 1}KB"
    assert cli_main(["quantize", str(src), str(tmp_path / "q"), "--plan", "auto", "--max-bytes", budget,
                     "--calibration-windows", "1", "--calibration-ctx", "64"]) == 0
    out = capsys.readouterr().out
    assert "gdn.in_proj" in out and "int4" in out and "KL int4" in out
    plan = json.loads((tmp_path / "q" / "config.json").read_text())[PLAN_KEY]
    assert plan["calibration"].endswith("argparse.py") and plan["windows"] == 1 and plan["ctx_size"] == 64
    assert plan["max_bytes"] == (math.ceil(int4 / 1e3) + 1) * 1000 >= plan["total_bytes"]
    for args, message in [(["--plan", "auto"], "--plan auto needs --max-bytes B"),
                          (["--max-bytes", "1GB", "--method", "int4"], "--max-bytes goes with --plan auto"),
                          (["--plan", "auto", "--max-bytes", "lots"], "'lots' is not a size"),
                          ([], "give --method int8 | int4, or --plan auto"),
                          (["--plan", "auto", "--max-bytes", "1GB", "--calibration", str(tmp_path / "no.txt")],
                           "cannot read --calibration")]:
        assert cli_main(["quantize", str(src), str(tmp_path / "x"), *args]) == 2
        assert message in capsys.readouterr().err, args
