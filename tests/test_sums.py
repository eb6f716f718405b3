"""The sums as records (``methods.SUMS``): what a pass gathers, their shapes and memory, the finite check and
plans pickled before the sums were held by name all follow from the table."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import random_batches, tiny_model

from ghostlayers.calibration.passes import calibrate
from ghostlayers.calibration.routing import pair_stats_bytes
from ghostlayers.errors import GhostLayersError
from ghostlayers.numerics.sums import PairStats
from ghostlayers.registry.methods import METHODS, SUMS, gathered, method
from ghostlayers.repair.pipeline import check_stats_finite


def test_each_method_gets_its_sums_in_the_shapes_the_records_say():
    model = tiny_model("llama")  # C = 64, the down-projection's input I = 128
    every = calibrate(model, random_batches(num=2), [(2, 4)], sums=gathered(METHODS), progress=False).pairs[(2, 4)]
    assert set(every.sums) == set(SUMS)
    for name, value in every.sums.items():
        assert tuple(value.shape) == SUMS[name].size({"C": 64, "I": 128}), name
    for name in METHODS:
        stats = calibrate(model, random_batches(num=2), [(2, 4)], sums=gathered([name]), progress=False).pairs[(2, 4)]
        assert stats.has(method(name).sums), name


def test_the_memory_a_route_counts_is_what_a_pair_holds():
    sums = gathered(["replaceme"])
    stats = calibrate(tiny_model("llama"), random_batches(num=2), [(2, 4)], sums=sums, progress=False).pairs[(2, 4)]
    assert pair_stats_bytes(64, 1, sums) == sum(v.numel() * v.element_size() for v in stats.sums.values())


def test_a_pair_without_a_layer_before_it_has_no_tapped_sums():
    sums = gathered(["replaceme"])
    stats = calibrate(tiny_model("llama"), random_batches(num=2), [(0, 2)], sums=sums, progress=False).pairs[(0, 2)]
    assert not stats.has(("ztz",)) and stats.has(("xtx",))


@pytest.mark.parametrize("name", ["ztd", "dtd", "atx", "ratio_h", "count"])
def test_every_gathered_sum_is_checked_finite(name):
    model = tiny_model("llama")
    stats = calibrate(model, random_batches(num=2), [(2, 4)], sums=gathered(METHODS), progress=False).pairs[(2, 4)]
    stats.sums[name].view(-1)[0] = float("nan")
    with pytest.raises(GhostLayersError, match=f"block 2..3: {SUMS[name].label} hold"):
        check_stats_finite(stats)


def test_plans_pickled_with_every_sum_a_field_still_load():
    """Before the sums were held by name, each was a field of PairStats and None when not gathered."""
    old = PairStats.__new__(PairStats)
    old.__dict__.update(pre=2, post=4, count=torch.tensor(3.0), xtx=torch.eye(2), ztz=None, atx=None)
    stats = pickle.loads(pickle.dumps(old))  # pickling keeps __dict__; loading goes through __setstate__
    assert (stats.pre, stats.post) == (2, 4)
    assert stats.has(("count", "xtx")) and not stats.has(("ztz",))
    torch.testing.assert_close(stats.xtx, torch.eye(2))
