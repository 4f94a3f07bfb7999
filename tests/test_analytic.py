"""The analytic (roofline) cost model: parameter counts, roofline behaviour, fits, presets."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import sys

import pytest

import schedlab
from schedlab.policies import make_policy
from schedlab.policies.base import CostModel, PassShape
from schedlab.sim import run_replica
from schedlab.analysis.analytic import (
    AnalyticCostModel,
    AnalyticError,
    Efficiency,
    analytic_from_config,
    engine_kind,
    fit_efficiency,
    kv_capacity_tokens,
    load_hardware,
    load_model_config,
    make_analytic_cost_model,
    model_spec,
)
from schedlab.analysis.analytic.fit import load_benchmarks, point_model, predict_point, refit
from schedlab.analysis.analytic.hardware import BENCHMARKS_FILE, HARDWARE_FILE, read_hardware_file
from schedlab.analysis.analytic.modelspec import bundled_model_configs, bits_per_weight
from schedlab.sim.cost import ProfileError
from schedlab.traces.schema import Request, Trace


def spec(name):
    n, cfg = load_model_config(name)
    return model_spec(cfg, n)


def cfg_of(name):
    return load_model_config(name)[1]


# ---------------------------------------------------------------------- parameter counts

# Published totals: the model cards (Qwen3 cards state total / non-embedding / activated
# parameters; llama-bench prints 8.03 B and 70.55 B for Llama 3 8B / 70B). Compared at the
# precision they are published with, rounded or truncated (3.35 B activated is "3.3B").
PUBLISHED = [
    ("llama-3.1-8b", "total", 8.03, 2),
    ("qwen3-0.6b", "total", 0.6, 1),
    ("qwen3-0.6b", "non_embedding", 0.44, 2),
    ("qwen3-4b", "total", 4.0, 1),
    ("qwen3-4b", "non_embedding", 3.6, 1),
    ("qwen3-8b", "total", 8.2, 1),
    ("qwen3-8b", "non_embedding", 6.95, 2),
    ("qwen3-30b-a3b", "total", 30.5, 1),
    ("qwen3-30b-a3b", "active", 3.3, 1),
    ("qwen3-30b-a3b", "non_embedding", 29.9, 1),
    ("qwen3-235b-a22b", "total", 235, 0),
    ("qwen3-235b-a22b", "active", 22, 0),
    ("qwen3-235b-a22b", "non_embedding", 234, 0),
    # hybrid Gated DeltaNet (linear attention 3 layers in 4) and sliding-window models: their
    # linear layers' own matrices counted ("80B in total", "79B non-embedding", "35B in total
    # and 3B activated", "27B"; GPT-OSS: "21B", "117B" total)
    ("qwen3-next-80b-a3b", "total", 80, 0),
    ("qwen3-next-80b-a3b", "non_embedding", 79, 0),
    ("qwen3.6-35b-a3b", "total", 35, 0),
    ("qwen3.6-35b-a3b", "active", 3, 0),
    ("qwen3.5-27b", "total", 27, 0),
    ("gpt-oss-20b", "total", 21, 0),
    ("gpt-oss-120b", "total", 117, 0),
    # GPT-OSS's "3.6B" and "5.1B active" count the vocabulary matrix once (embedding or head)
    ("gpt-oss-20b", "active_one_vocab", 3.6, 1),
    ("gpt-oss-120b", "active_one_vocab", 5.1, 1),
    # OPT-13B's model card: "13B" (the module count is 12.85 B: test_opt_13b_counts_every_module)
    ("opt-13b", "total", 13, 0),
]


@pytest.mark.parametrize("name,kind,billions,digits", PUBLISHED)
def test_parameter_counts_match_the_published_totals(name, kind, billions, digits):
    m = spec(name)
    n = {
        "total": m.total_params,
        "active": m.active_params,
        "non_embedding": m.non_embedding_params,
        "active_one_vocab": m.active_params - m.embed_params,
    }[kind]
    assert abs(n / 1e9 - billions) < 0.6 * 10**-digits


def test_every_bundled_config_is_read_and_dense_models_are_wholly_active():
    assert set(bundled_model_configs()) >= {"llama-3.1-8b", "qwen3-4b", "qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b"}
    for name in bundled_model_configs():
        m = spec(name)
        if m.is_moe:
            assert m.active_params < m.total_params / 4  # (GPT-OSS 20B: 4 of 32 experts, a 201k vocabulary)
        else:
            assert m.active_params == m.total_params


def test_opt_13b_counts_every_module():
    """OPTForCausalLM's parameters, module by module: q/k/v/out projections and fc1/fc2 with biases,
    two LayerNorms (weight and bias) per layer and a final one, learned positions of 2,048 + 2 rows,
    the embedding (word_embed_proj_dim = hidden: no projections) tied to the head: 12,853,473,280."""
    m = spec("opt-13b")
    h, f, L, V = 5120, 20480, 40, 50272
    layer = (4 * h * h + 4 * h) + (2 * h * f + f + h) + 2 * 2 * h
    assert m.total_params == L * layer + 2 * h + (2048 + 2) * h + V * h == 12_853_473_280
    assert m.tied and m.model_type == "opt" and m.kv_heads == m.heads == 40 and m.head_dim == 128
    assert m.active_matmul_params() == L * (4 * h * h + 4 * h + 2 * h * f + f + h)
    assert m.kv_bytes_per_token() == 2 * L * h * 2  # K and V, 16 bits, every layer: 0.82 MB
    assert m.weight_bytes() == pytest.approx(2 * m.total_params, rel=1e-12)  # all of it float16


def test_llama3_70b_shapes_in_the_benchmarks_count_70_55b():
    bench = load_benchmarks()
    p = next(p for p in bench["points"] if p["model"] == "llama-3-70b")
    assert abs(point_model(p).total_params / 1e9 - 70.55) < 0.006  # llama-bench's "70.55 B"


def test_counts_agree_with_the_engine_presets_formula():
    from schedlab.engine.models import preset_config, preset_parameters

    for name in ("micro", "tiny", "small"):
        assert model_spec(preset_config(name), name).total_params == preset_parameters(name)


def test_moe_layout_fields_of_other_families():
    base = dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        intermediate_size=256,
        tie_word_embeddings=True,
    )
    mixtral = model_spec(dict(base, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2), "mx")
    assert mixtral.moe_layers == 4 and mixtral.expert_params == 3 * 64 * 256  # expert width = intermediate_size
    ds = model_spec(
        dict(
            base,
            model_type="deepseek_v3",
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            n_shared_experts=1,
            first_k_dense_replace=1,
        ),
        "ds",
    )
    assert ds.moe_layers == 3 and ds.dense_layers == 1
    assert ds.shared_params == 64 * 16 + 3 * 64 * 32  # router + one shared expert
    qsparse = model_spec(
        dict(
            base,
            model_type="qwen3_moe",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
        ),
        "q",
    )
    assert qsparse.moe_layers == 1  # layers 1 and 3 are sparse by step, 3 is forced dense


def test_bad_configs_are_one_line_errors(tmp_path):
    with pytest.raises(AnalyticError, match="lacks"):
        model_spec({"hidden_size": 8}, "x")
    with pytest.raises(AnalyticError, match="num_experts_per_tok"):
        model_spec(dict(cfg_of("qwen3-30b-a3b"), num_experts_per_tok=500), "x")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(AnalyticError) as e:
        load_model_config(str(bad))
    assert "\n" not in str(e.value)
    good = tmp_path / "m"
    good.mkdir()
    (good / "config.json").write_text(json.dumps(cfg_of("qwen3-8b")))
    assert load_model_config(str(good))[0] == "m"  # a directory holding config.json works too


# ---------------------------------------------------------------------- roofline


@pytest.fixture(scope="module")
def h100_8b():  # the plain roofline (the published-figure fit's engine); the vllm engine: test_analytic_serving.py
    return make_analytic_cost_model("h100-sxm", "llama-3.1-8b", 16, engine="llama.cpp")[0]


def test_it_is_a_cost_model(h100_8b):
    assert isinstance(h100_8b, CostModel)
    # a step's own time is the efficiency block's step_overhead_s, whatever its passes and rows:
    # h100-sxm's llama.cpp block sets none (0: not modelled) ...
    assert h100_8b.efficiency.step_overhead_s == 0.0
    assert h100_8b.step_overhead_seconds(3, 10) == 0.0
    # ... and one that sets it gets exactly that, the same for one pass of one row as for many
    eff = dataclasses.replace(h100_8b.efficiency, step_overhead_s=0.0025)
    cm = AnalyticCostModel(h100_8b.hardware, h100_8b.model, h100_8b.bits, style=h100_8b.style, efficiency=eff)
    assert cm.step_overhead_seconds(3, 10) == cm.step_overhead_seconds(1, 1) == 0.0025
    assert cm.pass_seconds(PassShape(decode_contexts=(16,))) == h100_8b.pass_seconds(PassShape(decode_contexts=(16,)))


def test_one_row_decode_is_memory_bound_at_weights_over_bandwidth(h100_8b):
    cm = h100_8b
    m, hw = cm.model, cm.hardware
    shape = PassShape(decode_contexts=(16,))
    (f,) = cm.forwards(shape)
    assert cm.bound(f) == "memory"
    # every matrix and the head are read once; the input embedding only by rows; norms ignored
    weight_bytes = (m.total_params - m.embed_params - m.norm_params) * 2
    eff = hw.efficiency
    expected = weight_bytes / (hw.bandwidth * eff.bandwidth) + m.layers * eff.overhead_per_layer_s
    assert cm.pass_seconds(shape) == pytest.approx(expected, rel=0.01)  # the rest is 16 tokens of KV


def test_a_2048_token_prefill_is_compute_bound_at_flops_over_peak(h100_8b):
    cm = h100_8b
    m, hw = cm.model, cm.hardware
    shape = PassShape(prefill=((2048, 0),))
    (f,) = cm.forwards(shape)
    assert cm.bound(f) == "compute"
    matmul = m.total_params - 2 * m.embed_params - m.norm_params  # layers only
    flops = (
        2 * 2048 * matmul
        + 2 * m.vocab * m.hidden  # one head row
        + 4 * m.layers * m.heads * m.head_dim * 2048 * 2049 / 2
    )  # causal attention
    eff = hw.efficiency
    expected = flops / (hw.peak("fp16") * eff.compute) + m.layers * eff.overhead_per_layer_s
    assert cm.pass_seconds(shape) == pytest.approx(expected, rel=1e-9)


def test_padded_pass_costs_rows_times_longest():
    cm = make_analytic_cost_model("m4-max", "qwen3-8b", 4)[0]
    chunks = ((100, 0), (300, 50), (200, 10))
    padded = cm.pass_seconds(PassShape(prefill=chunks, padded=True))
    rows_x_longest = cm.pass_seconds(PassShape(prefill=((300, 50),) * 3, padded=True))
    assert padded == pytest.approx(rows_x_longest, rel=1e-12)
    assert padded > cm.pass_seconds(PassShape(prefill=((300, 50),), padded=True))


@pytest.mark.parametrize("style", ["mlx", "fused"])
def test_a_mixed_pass_costs_at_least_each_of_its_parts(style):
    hw = load_hardware("m4-max")
    cm = analytic_from_config(hw, cfg_of("qwen3-30b-a3b"), 4, style=style)
    rng = random.Random(0)
    for _ in range(200):
        decode = tuple(rng.randint(1, 8000) for _ in range(rng.randint(1, 16)))
        chunks = tuple((rng.randint(1, 1024), rng.randint(0, 4000)) for _ in range(rng.randint(1, 3)))
        padded = rng.random() < 0.5
        both = cm.pass_seconds(PassShape(decode_contexts=decode, prefill=chunks, padded=padded))
        d = cm.pass_seconds(PassShape(decode_contexts=decode))
        p = cm.pass_seconds(PassShape(prefill=chunks, padded=padded))
        assert both >= max(d, p) - 1e-15
        if style == "mlx":  # separate forwards: exactly the sum
            assert both == pytest.approx(d + p, rel=1e-12)
        else:  # one forward reads the weights once: less than the sum
            assert both < d + p


def test_pass_seconds_is_the_sum_of_its_forwards():
    cm = make_analytic_cost_model("l40s", "qwen3-30b-a3b", 8, engine="llama.cpp")[0]
    rng = random.Random(3)
    for _ in range(300):
        s = PassShape(
            decode_contexts=tuple(rng.randint(1, 5000) for _ in range(rng.randint(0, 8))),
            prefill=tuple((rng.randint(1, 900), rng.randint(0, 3000)) for _ in range(rng.randint(0, 3))),
            padded=rng.random() < 0.5,
            batch_rows_before=rng.randint(0, 8),
            joins=rng.randint(0, 2),
            leaves=rng.randint(0, 3),
        )
        assert cm.pass_seconds(s) == pytest.approx(sum(cm.forward_seconds(f) for f in cm.forwards(s)), rel=1e-12)


def test_cost_grows_with_context_rows_and_batch_cache_copies():
    cm = make_analytic_cost_model("m2-ultra", "llama-3.1-8b", 4)[0]
    short = cm.pass_seconds(PassShape(decode_contexts=(1000,) * 8))
    long = cm.pass_seconds(PassShape(decode_contexts=(32000,) * 8))
    assert long > short
    # mlx-lm's batch cache is left-padded: one long row makes every row pay for it
    assert cm.pass_seconds(PassShape(decode_contexts=(100,) * 7 + (32000,))) == pytest.approx(long, rel=1e-12)
    joined = cm.pass_seconds(PassShape(decode_contexts=(1000,) * 8, batch_rows_before=7, joins=1))
    assert joined > short
    fused = analytic_from_config(cm.hardware, cfg_of("llama-3.1-8b"), 4, style="fused")
    assert fused.pass_seconds(PassShape(decode_contexts=(100,) * 7 + (32000,))) < long  # paged: no padding


def test_moe_tokens_touch_more_experts_up_to_all_of_them():
    m = spec("qwen3-30b-a3b")
    assert m.distinct_experts(1) == pytest.approx(m.top_k)
    hits = [m.distinct_experts(t) for t in (1, 2, 4, 16, 64, 256, 4096)]
    assert all(a < b for a, b in zip(hits, hits[1:]))
    assert hits[-1] == pytest.approx(m.n_experts) and max(hits) <= m.n_experts
    cm = make_analytic_cost_model("m4-max", "qwen3-30b-a3b", 4)[0]
    read = [cm.weight_bytes_read(t) for t in (1, 16, 4096)]
    assert read[0] < read[1] < read[2] <= cm.weight_bytes_read(10**6)
    dense = make_analytic_cost_model("m4-max", "qwen3-8b", 4)[0]
    assert dense.weight_bytes_read(1) == dense.weight_bytes_read(4096)


def test_quantisation_scales_weight_bytes_with_group_overhead():
    assert bits_per_weight(4) == 4.5 and bits_per_weight(8) == 8.5 and bits_per_weight(16) == 16
    m = spec("qwen3-4b")
    q4 = m.weight_bytes(4)
    bf16 = m.weight_bytes(16)
    norms = m.norm_params * 2
    assert (q4 - norms) / (bf16 - norms) == pytest.approx(4.5 / 16)
    c4 = make_analytic_cost_model("m4-max", "qwen3-4b", 4)[0]
    c16 = make_analytic_cost_model("m4-max", "qwen3-4b", 16)[0]
    one = PassShape(decode_contexts=(1,))
    assert c4.pass_seconds(one) < c16.pass_seconds(one)
    big = PassShape(prefill=((4096, 0),))  # compute-bound: the weights' width hardly matters
    assert c4.pass_seconds(big) == pytest.approx(c16.pass_seconds(big), rel=0.01)


# ---------------------------------------------------------------------- fitted efficiencies


@pytest.fixture(scope="module")
def fits():
    return refit(write=False)


def test_stored_efficiencies_are_what_the_fit_gives(fits):
    presets = read_hardware_file()["presets"]
    for name, res in fits.items():
        stored = presets[name]["efficiency"]
        e = res.efficiency
        assert stored["basis"] == "fitted" and stored["source"]
        for k in ("compute", "bandwidth", "overhead_per_layer_s"):
            assert stored[k] == pytest.approx(getattr(e, k), rel=2e-3), (name, k)
        if e.moe:
            for k in ("compute", "bandwidth", "overhead_per_layer_s"):
                assert stored["moe"][k] == pytest.approx(e.moe[k], rel=2e-3), (name, "moe", k)
        assert stored["fit"]["max_abs_residual"] == pytest.approx(res.max_abs_residual, abs=1e-4)


def test_predictions_of_the_fitted_figures_are_within_the_reported_residuals(fits):
    bench = load_benchmarks()
    presets = read_hardware_file()["presets"]
    for name in fits:
        # the stored efficiency, as a user of that engine gets it (NVIDIA presets default to vllm)
        hw = load_hardware(name, engine=engine_kind(presets[name]["efficiency"]["engine"]))
        bound = presets[name]["efficiency"]["fit"]["max_abs_residual"]
        points = [p for p in bench["points"] if p["hardware"] == name and p.get("role", "fit") == "fit"]
        assert points
        for p in points:
            pred = predict_point(p, hw)
            rel = float(p["tok_s"]) / pred - 1.0  # predicted seconds / published seconds - 1
            assert abs(rel) <= bound + 2e-3, (name, p.get("metric") or p.get("test"), rel, bound)


def test_the_fits_are_tight_where_the_data_is_rich(fits):
    m4 = fits["m4-max"]  # 22 MLX figures, two models, seven quantisations
    assert len(m4.residuals) == 22 and m4.rms_residual < 0.05 and m4.max_abs_residual < 0.15
    for name, res in fits.items():
        assert res.max_abs_residual < 0.2, name
        held = [c for c in res.checks if c["reason"].startswith("held out")]
        for c in held:
            assert abs(c["rel"]) < 0.4, (name, c["label"])  # an unrelated model size, never fitted
        e = res.efficiency
        assert 0 < e.compute <= 1 and 0 < e.bandwidth <= 1
        # a per-layer launch floor of tens to hundreds of microseconds: a fit that lost the term
        # (0), went negative or slipped a unit (ms, us) lands outside
        assert 1e-5 < e.overhead_per_layer_s < 1e-3, (name, e.overhead_per_layer_s)


def test_every_preset_has_an_efficiency_with_a_source():
    presets = read_hardware_file()["presets"]
    fitted = {n for n, p in presets.items() if p.get("efficiency", {}).get("basis") == "fitted"}
    for name, p in presets.items():
        if name == "cpu-local":
            continue
        eff = p["efficiency"]
        assert eff["source"], name
        assert eff["basis"] in ("fitted", "borrowed"), name
        if eff["basis"] == "borrowed":
            assert eff["from"] in fitted and presets[eff["from"]]["family"] == p["family"], name


def test_fit_efficiency_recovers_known_factors():
    hw = load_hardware("m3-max")
    true = Efficiency(0.4, 0.65, 3e-4)
    cm = analytic_from_config(hw, cfg_of("qwen3-8b"), 4, efficiency=true)
    rng = random.Random(7)
    shapes = [
        PassShape(decode_contexts=tuple(rng.randint(10, 4000) for _ in range(rng.randint(1, 16)))) for _ in range(12)
    ]
    shapes += [PassShape(prefill=((rng.randint(256, 2048), rng.randint(0, 1000)),)) for _ in range(6)]
    shapes += [PassShape(prefill=((rng.randint(1, 8), 0),)) for _ in range(3)]  # tiny: overhead shows
    samples = [(s, cm.pass_seconds(s)) for s in shapes]
    res = fit_efficiency(samples, hardware=hw, model=cfg_of("qwen3-8b"), quant=4)
    e = res.efficiency
    assert (e.compute, e.bandwidth, e.overhead_per_layer_s) == pytest.approx((0.4, 0.65, 3e-4), rel=1e-3)
    assert res.max_abs_residual < 1e-6 and set(res.fitted) == {"compute", "bandwidth", "overhead_per_layer_s"}


def test_fit_efficiency_keeps_priors_it_cannot_identify():
    hw = load_hardware("m3-max")
    cm = analytic_from_config(hw, cfg_of("qwen3-8b"), 4, efficiency=Efficiency(0.4, 0.65, 3e-4))
    # one-row decodes are memory-bound (a few rows of an 8B model already are not, on an M3 Max)
    shapes = [PassShape(decode_contexts=(c,)) for c in (100, 20000, 40000)]
    assert all(cm.bound(f) == "memory" for s in shapes for f in cm.forwards(s))
    decode_only = [(s, cm.pass_seconds(s)) for s in shapes]
    res = fit_efficiency(decode_only, hardware=hw, model=cfg_of("qwen3-8b"), quant=4, prior=Efficiency(0.3, 0.5, 1e-4))
    assert "compute" not in res.fitted and res.efficiency.compute == pytest.approx(0.3)
    assert (res.efficiency.bandwidth, res.efficiency.overhead_per_layer_s) == pytest.approx((0.65, 3e-4), rel=1e-3)
    with pytest.raises(AnalyticError):
        fit_efficiency([], hardware=hw, model="qwen3-8b")
    with pytest.raises(AnalyticError):
        fit_efficiency([(PassShape(decode_contexts=(1,)), -1.0)], hardware=hw, model="qwen3-8b")


# ---------------------------------------------------------------------- KV capacity and errors


def test_kv_capacity_is_memory_left_after_weights_over_kv_per_token():
    hw = load_hardware("h100-sxm")
    cfg = cfg_of("llama-3.1-8b")
    m = model_spec(cfg, "llama-3.1-8b")
    per_token = (
        2
        * cfg["num_hidden_layers"]
        * cfg["num_key_value_heads"]
        * (cfg["hidden_size"] // cfg["num_attention_heads"])
        * 2
    )
    assert m.kv_bytes_per_token() == per_token
    expected = int((hw.memory_bytes * 0.9 - m.weight_bytes(16)) // per_token)
    assert kv_capacity_tokens(hw, m, 16) == expected
    assert kv_capacity_tokens(hw, m, 4) > expected  # smaller weights leave more room
    assert kv_capacity_tokens(hw, m, 16, mem_fraction=0.5) < expected


def test_weights_that_do_not_fit_are_a_one_line_error():
    with pytest.raises(AnalyticError) as e:
        make_analytic_cost_model("m4-max", "qwen3-235b-a22b", 16)
    msg = str(e.value)
    assert "qwen3-235b-a22b at 16 bits needs 470 GB of weights; m4-max has 128 GB" in msg and "\n" not in msg
    assert isinstance(e.value, ValueError) and isinstance(e.value, ProfileError)  # the CLI prints these as one line
    cost, kv, meta = make_analytic_cost_model("m3-ultra", "qwen3-235b-a22b", 4)
    assert kv > 100_000 and meta["kv_tokens"] == kv and meta["weight_gb"] < 512


@pytest.mark.parametrize(
    "args,fragment",
    [
        (("m9", "qwen3-4b", 4), "unknown hardware 'm9' (presets: a100-40gb-sxm"),
        (("m4-max", "qwen9", 4), "unknown model config 'qwen9' (bundled: gpt-oss-120b, gpt-oss-20b, llama-2-7b"),
        (("m4-max", "qwen3-4b", 7), "--quant must be one of 2, 3, 4, 5, 6, 8, 16, 32 bits, got 7"),
    ],
)
def test_unknown_names_list_the_choices(args, fragment):
    with pytest.raises(AnalyticError) as e:
        make_analytic_cost_model(*args)
    assert fragment in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------- tensor parallelism

TP_SHAPES = [
    PassShape(decode_contexts=(700,) * 48),
    PassShape(prefill=((1024, 0),)),
    PassShape(decode_contexts=(300, 900), prefill=((256, 512),)),
]


def test_tp_1_suffix_is_the_plain_preset_float_for_float():
    for engine in ("vllm", "llama.cpp"):
        plain, kv, _ = make_analytic_cost_model("a100-80gb-sxm", "opt-13b", None, engine=engine)
        one, kv1, meta = make_analytic_cost_model("A100-80GB-SXM:tp=1", "opt-13b", None, engine=engine)
        assert kv1 == kv and meta["tp"] == 1 and "tensor_parallel" not in meta
        assert [one.pass_seconds(s) for s in TP_SHAPES] == [plain.pass_seconds(s) for s in TP_SHAPES]


def test_tp_2_halves_a_weight_bound_decode_up_to_the_all_reduces():
    """A decode step of one row is the weights' read: at tp = 2 each GPU reads half of them (and half
    the KV), so the step is half as long, plus 2 all-reduces per layer of the row's hidden state, the
    fixed per-layer costs unchanged."""
    hw1, hw2 = (
        load_hardware("a100-80gb-sxm", engine="llama.cpp"),
        load_hardware("a100-80gb-sxm:tp=2", engine="llama.cpp"),
    )
    assert hw2.tp == 2 and hw2.tp_link == "nvlink3" and hw2.tp_link_bandwidth == 300e9
    eff = Efficiency(0.5, 0.7, 0.0)  # no per-layer overhead: the roofline alone
    one = analytic_from_config(hw1, cfg_of("opt-13b"), efficiency=eff, style="fused")
    two = analytic_from_config(hw2, cfg_of("opt-13b"), efficiency=eff, style="fused")
    step = PassShape(decode_contexts=(100,))
    ar = two.allreduce_seconds(1)
    assert ar == 2 * 40 * hw2.allreduce_seconds(5120 * 2) == 2 * 40 * (2 * 1 / 2) * 5120 * 2 / 300e9
    assert two.pass_seconds(step) - ar == pytest.approx(one.pass_seconds(step) / 2, rel=1e-12)
    assert one.allreduce_seconds(1) == 0.0
    # the vllm engine: the same, its fixed costs (per-layer and decode-attention overheads) aside
    v1, _, _ = make_analytic_cost_model("a100-80gb-sxm", "opt-13b", None)
    v2, _, meta = make_analytic_cost_model("a100-80gb-sxm:tp=2", "opt-13b", None)
    s = v1.serving
    fixed = 40 * (s.overhead_per_layer_s + s.decode_overhead_per_layer_s + s.decode_per_row_s)
    half = (v1.pass_seconds(step) - fixed) / 2
    assert v2.pass_seconds(step) - v2.allreduce_seconds(1) - fixed == pytest.approx(half, rel=1e-9)
    assert meta["tp"] == 2 and meta["tensor_parallel"]["allreduces_per_forward"] == 80
    # a compute-bound prefill: about half too (its GEMMs' efficiency is read at the same token count)
    pre = PassShape(prefill=((2048, 0),))
    assert 0.45 < v2.pass_seconds(pre) / v1.pass_seconds(pre) < 0.56


def test_tp_2_holds_twice_the_memory_less_one_copy_of_the_weights():
    _, kv1, _ = make_analytic_cost_model("a100-80gb-sxm", "opt-13b", None)
    _, kv2, _ = make_analytic_cost_model("a100-80gb-sxm:tp=2", "opt-13b", None)
    m = spec("opt-13b")
    per_token, weights = m.kv_bytes_per_token(), m.weight_bytes()
    assert kv1 == int((80e9 * 0.9 - weights) // per_token)
    assert kv2 == int((2 * 80e9 * 0.9 - weights) // per_token)
    assert kv2 - 2 * kv1 == pytest.approx(weights / per_token, abs=2)  # the weights are held once
    # fewer KV heads than GPUs (GQA): each GPU keeps a whole head, repeated tp / kv_heads times
    llama = spec("llama-3.1-8b")  # 32 heads, 8 KV heads
    h100 = load_hardware("h100-sxm:tp=16")
    assert kv_capacity_tokens(h100, llama) == int(
        (16 * 80e9 * 0.9 - llama.weight_bytes()) // (2 * llama.kv_bytes_per_token())
    )


@pytest.mark.parametrize(
    "hardware,fragment",
    [
        ("a100-80gb-sxm:tp=0", "tp must be an integer >= 1"),
        ("a100-80gb-sxm:tp=two", "tp must be an integer >= 1"),
        ("a100-80gb-sxm:pp=2", "unknown option 'pp=2'"),
        ("a100-80gb-sxm:tp=2,tp=4", "tp given twice"),
        ("a100-80gb-sxm:tp=3", "tp=3 does not divide opt-13b's 40 attention heads"),
        ("m4-max:tp=2", "names no link between its GPUs"),
        ("a100-9000:tp=2", "unknown hardware 'a100-9000:tp=2'"),
    ],
)
def test_a_bad_tp_is_one_line(hardware, fragment):
    with pytest.raises(AnalyticError) as e:
        make_analytic_cost_model(hardware, "opt-13b", None)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ProfileError)  # the CLI prints these as one line


def test_a_cluster_group_takes_a_tp_hardware_and_its_transfer_the_presets_link(tmp_path):
    from schedlab.api.options import ClusterOptions
    from schedlab.api.deployments import _transfer

    f = tmp_path / "pd.toml"
    f.write_text(
        'router = "least-requests"\n\n[transfer]\nmode = "layerwise"\n\n'
        '[[group]]\npool = "prefill"\npolicy = "vllm"\nhardware = "a100-80gb-sxm:tp=2"\nmodel_config = "opt-13b"\n\n'
        '[[group]]\npool = "decode"\npolicy = "vllm"\nhardware = "a100-80gb-sxm"\nmodel_config = "opt-13b"\n'
    )
    cu = ClusterOptions.from_file(f)
    t = _transfer(cu, "")
    assert t.link.name == "nvlink3" and t.bytes_per_token == spec("opt-13b").kv_bytes_per_token()
    run = schedlab.simulate(None, mixed_small(), cluster=cu, passes=False)
    caps = [r["kv_tokens"] for r in run.summary["replicas"]]
    assert caps[0] > 2 * caps[1]  # the TP-2 prefill replica holds twice the memory, the weights once


def mixed_small():
    return Trace("small", "", [Request(f"r{i}", i * 0.05, 100 + 37 * i % 400, 8 + i % 20) for i in range(30)])


# ---------------------------------------------------------------------- presets and sources


def test_every_preset_figure_has_a_source_that_exists():
    data = json.loads(HARDWARE_FILE.read_text())
    sources = data["sources"]
    for sid, s in sources.items():
        assert s["url"] and s["title"], sid
    required = {
        "m1",
        "m1-pro",
        "m1-max",
        "m1-ultra",
        "m2",
        "m2-pro",
        "m2-max",
        "m2-ultra",
        "m3",
        "m3-pro",
        "m3-max",
        "m3-ultra",
        "m4",
        "m4-pro",
        "m4-max",
        "a100-40gb-sxm",
        "a100-80gb-sxm",
        "h100-sxm",
        "h100-pcie",
        "h200",
        "l40s",
        "cpu-local",
    }
    assert required <= set(data["presets"])
    used = set()
    for name, p in data["presets"].items():
        if name == "cpu-local":
            continue
        figures = [p["memory_gb"], p["bandwidth_gbs"], *p["peak_tflops"].values()]
        assert p["default_compute"] in p["peak_tflops"], name
        for fig in figures:
            assert fig["value"] > 0 and fig["sources"], name
            for sid in fig["sources"]:
                assert sid in sources, (name, sid)
                used.add(sid)
    assert used <= set(sources)
    bench = load_benchmarks()
    for p in bench["points"]:
        assert p["source"] in bench["sources"] and p["tok_s"] > 0
    assert json.loads(BENCHMARKS_FILE.read_text()) == bench


def test_cpu_local_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SCHEDLAB_CACHE_DIR", str(tmp_path))
    hw = load_hardware("cpu-local")
    cache = tmp_path / "cpu-local.json"
    assert cache.is_file()
    assert hw.peak("fp32") > 1e9 and hw.bandwidth > 1e8 and hw.memory_bytes > 1e8
    machines = json.loads(cache.read_text())["machines"]
    assert len(machines) == 1
    again = load_hardware("cpu-local")  # from the cache: the very same figures
    assert again.peak("fp32") == hw.peak("fp32") and again.bandwidth == hw.bandwidth
    # a model built from the engine's tiny preset (any config dict works)
    from schedlab.engine.models import preset_config

    cm = analytic_from_config(hw, preset_config("tiny"), None)
    assert cm.model.native_bits == 16  # presets have no torch_dtype: bf16 assumed unless told
    one = cm.pass_seconds(PassShape(decode_contexts=(64,)))
    assert math.isfinite(one) and one > 0
    assert cm.pass_seconds(PassShape(decode_contexts=(64,) * 8, prefill=((256, 0),))) > one


def test_the_analytic_model_never_imports_mlx():
    code = (
        "import sys; from schedlab.analysis.analytic import make_analytic_cost_model; "
        "from schedlab.policies.base import PassShape; "
        "c, kv, m = make_analytic_cost_model('m3-ultra', 'qwen3-235b-a22b', 4); "
        "c.pass_seconds(PassShape(decode_contexts=(10,))); "
        "assert not [k for k in sys.modules if k == 'mlx' or k.startswith('mlx.')], 'mlx imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------- in the simulator


def test_the_simulator_runs_on_an_analytic_model_and_faster_hardware_is_faster():
    reqs = [Request(f"r{i}", 0.05 * i, 200 + 37 * i, 16 + (i % 5)) for i in range(24)]
    makespans = {}
    for hw in ("m1", "h100-sxm"):
        cost, kv, _ = make_analytic_cost_model(hw, "llama-3.1-8b", 4)
        for pol in ("mlx-default", "chunked-prefill"):
            res = run_replica(reqs, make_policy(pol), cost, kv_capacity=kv)
            assert res.error is None and not res.rejected
            assert all(r.finish_s is not None for r in res.requests) and len(res.requests) == len(reqs)
            makespans[hw, pol] = max(r.finish_s for r in res.requests)
    for pol in ("mlx-default", "chunked-prefill"):
        assert makespans["h100-sxm", pol] < makespans["m1", pol] / 3


def test_presets_md_is_what_refit_writes_from_hardware_json_prices_included():
    from schedlab.analysis.analytic.fit import HARDWARE_DIR, presets_report

    data = json.loads((HARDWARE_DIR / "hardware.json").read_text())
    text = (HARDWARE_DIR / "PRESETS.md").read_text()
    assert text == presets_report(data), "PRESETS.md is stale: python -m schedlab.analysis.analytic refit"
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    col = rows["preset"].index("$/h")
    for name, p in data["presets"].items():
        price = p.get("price_usd_per_hour")
        assert rows[name][col] == (format(price["value"], "g") if price else "-"), name


def test_gpt_oss_weights_cost_what_its_checkpoint_ships_mxfp4_experts_unless_a_quant_is_given():
    # gpt-oss's config says quantization_config mxfp4 (its routed experts; attention, router,
    # embeddings and head kept at 16 bits): 120b fits one 80 GB H100, as it is served
    cost, kv, meta = make_analytic_cost_model("h100-sxm", "gpt-oss-120b", None)
    assert meta["expert_bits_per_weight"] == 4.25 and meta["bits_per_weight"] == 16
    name, cfg = load_model_config("gpt-oss-120b")
    m = model_spec(cfg, name)
    experts = m.all_expert_params
    assert experts > 0.9 * m.total_params  # (nearly all of it)
    assert m.weight_bytes() == pytest.approx(m.weight_bytes(16) - experts * (16 - 4.25) / 8)
    assert meta["weight_gb"] == pytest.approx(
        ((m.layer_matrix_params + 2 * m.embed_params) * 2 - experts * (2 - 4.25 / 8)) / 1e9
    )
    assert 60 < m.weight_bytes() / 1e9 < 70 and kv > 0
    # a decode step reads the experts it routes to at their stored size: fewer bytes than at 16 bits
    at16, _, _ = make_analytic_cost_model("h100-sxm", "gpt-oss-20b", 16)
    mx, _, _ = make_analytic_cost_model("h100-sxm", "gpt-oss-20b", None)
    assert mx.weight_bytes_read(64) < at16.weight_bytes_read(64)
    with pytest.raises(AnalyticError, match="gpt-oss-120b at 16 bits needs 234 GB"):
        make_analytic_cost_model("h100-sxm", "gpt-oss-120b", 16)  # (asked for: every matrix at 16 bits)
    # a model whose config says nothing of it is unchanged: every matrix at its native bits
    name, cfg = load_model_config("qwen3-30b-a3b")
    assert model_spec(cfg, name).expert_bits is None
