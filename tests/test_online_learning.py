"""The online-learning identity (lineattn.experiments.online_learning): every rule is one gradient step."""

import pytest

from lineattn.experiments import online_learning as ol

EXPECTED = {
    "additive_write", "delta_write", "gdn_decay_then_step", "kda_decay_then_step", "delta_element_decay_then_step",
    "gdn_order_matters", "scalar_decay_is_weight_decay", "channel_decay_is_channel_weight_decay",
    "element_decay_is_element_weight_decay", "l2_sgd_step", "kda_split_step", "simple_gla_is_l2_step",
    "gla_is_channel_l2_step", "deltanet_overwrite", "gdn_overwrite", "kda_overwrite", "deltanet_orthogonal_read",
    "kda_orthogonal_read", "contraction", "contraction_needs_small_beta", "kda_sequence_chunk",
}


@pytest.fixture(scope="module")
def rows():
    return {r.name: r for r in ol.checks(seed=0)}


def test_every_check_is_there(rows):
    assert set(rows) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_check_holds(rows, name):
    r = rows[name]
    assert r.ok, f"{name}: {r.claim}: measured {r.value:.3g}, needs {r.op} {r.bound:.3g}"


def test_identities_are_tight(rows):
    # fp32 identities: a few ulps, far inside the 2e-6 bound
    for r in rows.values():
        if r.op == "<=" and r.bound == ol.TOL:
            assert r.value < 1e-6, r.name


def test_table(rows):
    out = ol.report(list(rows.values()))
    assert "21/21 checks pass" in out and "| kda_split_step |" in out
    assert all(line.count(" | ") == 4 for line in out.splitlines() if line.startswith("| "))   # pipes escaped
