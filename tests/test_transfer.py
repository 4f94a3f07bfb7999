"""Moving a request's KV between replicas (prefill/decode disaggregation): its bytes from the
model's config, its time over a link preset, and the layer-wise overlap with the prefill."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedlab.analysis.analytic import AnalyticError, kv_transfer, link_preset, list_links
from schedlab.analysis.analytic.hardware import HARDWARE_FILE
from schedlab.analysis.analytic.modelspec import load_model_config
from schedlab.sim.transfer import KVTransfer, Link, TransferError


def test_llama_3_1_8b_moves_the_closed_form_bytes_per_token():
    _, cfg = load_model_config("llama-3.1-8b")
    # K and V of every layer: layers x KV heads x head dim x 2 (K, V) x 2 bytes (bf16)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    closed = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * 2
    assert closed == 32 * 8 * 128 * 2 * 2  # the published config: 128 KiB per token
    t = kv_transfer("llama-3.1-8b", "h100-sxm", "whole")
    assert t.bytes(1) == closed and t.bytes(1000) == 1000 * closed
    assert t.layers == 32 and t.link.name == "nvlink4"
    # whole: latency + bytes / bandwidth
    assert t.seconds(1000) == pytest.approx(1000 * closed / 450e9)
    assert kv_transfer("llama-3.1-8b", "pcie5-x16", "whole", latency_s=1e-3).seconds(1000) == pytest.approx(
        1e-3 + 1000 * closed / 64e9
    )
    # 8-bit KV halves the bytes
    assert kv_transfer("llama-3.1-8b", "nvlink4", kv_bits=8).bytes(1) == closed / 2


def _layer_by_layer(t: KVTransfer, tokens: int, prefill_s: float) -> float:
    """Each layer's KV sent when that layer is computed, one after another on the link."""
    n = t.layers
    c = prefill_s / n
    x = t.bytes(tokens) / n / (t.link.bandwidth_gbs * 1e9)
    done = 0.0
    for i in range(1, n + 1):
        done = max(done, i * c) + x
    return t.link.latency_s + done - n * c


@settings(max_examples=200, deadline=None)
@given(
    layers=st.integers(1, 128),
    tokens=st.integers(1, 200_000),
    bpt=st.floats(1.0, 1e7),
    bw=st.floats(0.1, 2000.0),
    lat=st.floats(0.0, 0.01),
    prefill_s=st.floats(0.0, 30.0),
)
def test_layerwise_overlap_equals_sending_each_layer_as_it_is_computed(layers, tokens, bpt, bw, lat, prefill_s):
    lw = KVTransfer(bpt, layers, Link(bw, lat), "layerwise")
    whole = KVTransfer(bpt, layers, Link(bw, lat), "whole")
    exposed = lw.exposed_seconds(tokens, prefill_s)
    assert exposed == pytest.approx(_layer_by_layer(lw, tokens, prefill_s), rel=1e-9, abs=1e-12)
    # never more than sending it whole after the prefill, never less than its last layer
    assert exposed <= whole.exposed_seconds(tokens, prefill_s) * (1 + 1e-12)
    assert exposed >= lat + lw.bytes(tokens) / layers / (bw * 1e9) * (1 - 1e-12)
    assert whole.exposed_seconds(tokens, prefill_s) == whole.seconds(tokens)


def test_every_link_cites_sources_and_every_preset_link_exists():
    data = json.loads(HARDWARE_FILE.read_text())
    links = data["links"]
    assert set(list_links()) == set(links) >= {"nvlink4", "pcie5-x16", "ib-ndr-400"}
    for name, entry in links.items():
        fig = entry["bandwidth_gbs"]
        assert fig["value"] > 0 and fig["sources"], name
        assert all(sid in data["sources"] for sid in fig["sources"]), name
        assert link_preset(name).bandwidth_gbs == fig["value"]
    for name, preset in data["presets"].items():
        if "link" in preset:
            assert preset["link"] in links, name
            assert link_preset(name).name == preset["link"]


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: link_preset("warp-drive"), "unknown link 'warp-drive'"),
        (lambda: link_preset("m4-max"), "hardware preset m4-max names no link"),
        (lambda: link_preset("nvlink4", latency_s=-1.0), "latency (s) must be >= 0"),
        (lambda: kv_transfer("llama-3.1-8b", "nvlink4", "teleport"), "transfer mode must be one of"),
        (lambda: kv_transfer("no-such-model", "nvlink4"), "no-such-model"),
    ],
)
def test_bad_links_and_transfers_are_one_line_errors(call, message):
    with pytest.raises(AnalyticError) as exc:
        call()
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_a_link_or_transfer_that_cannot_be_is_refused():
    for bad in (0, -5, float("nan"), float("inf"), True, "fast"):
        with pytest.raises(TransferError, match="bandwidth"):
            Link(bad)
    with pytest.raises(TransferError, match="layers"):
        KVTransfer(1.0, 0, Link(1.0))
    with pytest.raises(TransferError, match="bytes per token"):
        KVTransfer(0.0, 4, Link(1.0))
