"""Capacity buckets: the spec's test vector, covering choice, exact prefill splits, bad lists, JSON."""

import pytest

from k3trt.engine.capacities import (Capacities, CapacityError, parse_capacity_list, pick, power_of_two_capacities,
                                     split_prefill, validate)


def test_spec_vector():
    caps = power_of_two_capacities(28)
    assert caps == (1, 2, 4, 8, 16, 28)
    assert pick(caps, 3) == 4
    assert pick(caps, 1) == 1 and pick(caps, 16) == 16 and pick(caps, 17) == 28 and pick(caps, 28) == 28
    with pytest.raises(CapacityError, match="29 live entries exceed the largest capacity 28"):
        pick(caps, 29)


@pytest.mark.parametrize("largest,want", [(1, (1,)), (2, (1, 2)), (32, (1, 2, 4, 8, 16, 32)), (5, (1, 2, 4, 5))])
def test_power_of_two_capacities(largest, want):
    assert power_of_two_capacities(largest) == want


@pytest.mark.parametrize("caps,msg", [((), "empty"), ((0, 1), "not integers"), ((2, 1), "ascending"),
                                      ((1, 1), "distinct"), ((1, "2"), "not integers"), ((True,), "not integers"),
                                      ((1, 2.0), "not integers")])
def test_invalid_lists_are_refused(caps, msg):
    with pytest.raises(CapacityError, match=msg):
        validate(caps, "verify")


def test_parse_capacity_list():
    assert parse_capacity_list("1,2, 4,8") == (1, 2, 4, 8)
    with pytest.raises(CapacityError, match="comma-separated integers"):
        parse_capacity_list("1,two")
    with pytest.raises(CapacityError, match="ascending"):
        parse_capacity_list("4,2")


def test_split_prefill_is_exact_and_largest_first():
    caps = power_of_two_capacities(128)
    for n in range(1, 400):
        parts = split_prefill(caps, n)
        assert sum(parts) == n and list(parts) == sorted(parts, reverse=True) and set(parts) <= set(caps)
    assert split_prefill(caps, 300) == (128, 128, 32, 8, 4)
    with pytest.raises(CapacityError, match="not a sum"):
        split_prefill((4, 8), 5)


def test_capacities_round_trip_and_checks():
    caps = Capacities.plan(max_batch=28, max_num_tokens=256, spec_tokens=3)
    assert caps.verify == (1, 2, 4, 8, 16, 28) and caps.prefill[0] == 1 and caps.prefill[-1] == 256
    assert caps.verify_rows(28) == 112 and caps.pick_verify(3) == 4
    assert Capacities.from_json(caps.to_json()) == caps
    assert Capacities.from_dict({"verify": [1, 2], "prefill": [1, 4]}).spec_tokens == 3
    with pytest.raises(CapacityError, match="more than max_num_tokens"):
        Capacities.plan(max_batch=32, max_num_tokens=64, spec_tokens=3)
    with pytest.raises(CapacityError, match="must start at 1"):
        Capacities((1,), (2, 4))
    with pytest.raises(CapacityError, match="spec_tokens"):
        Capacities((1,), (1,), spec_tokens=9)
    with pytest.raises(CapacityError, match="not valid"):
        Capacities.from_json("{")
    with pytest.raises(CapacityError, match="'verify' and 'prefill'"):
        Capacities.from_dict({"verify": [1]})
    with pytest.raises(Exception):              # frozen
        caps.verify = (1,)


def test_encoder_capacities():
    caps = Capacities((1,), (1,), encoder=(256, 1024))
    assert caps.pick_encoder(1) == 256 and caps.pick_encoder(300) == 1024
    assert caps.within(max_batch=1).encoder == (256, 1024)
    assert Capacities.from_json(caps.to_json()) == caps
    with pytest.raises(CapacityError, match="encoder capacities"):
        Capacities((1,), (1,), encoder=(1024, 256))
    with pytest.raises(CapacityError, match="exceed the largest capacity 1024"):
        caps.pick_encoder(1025)
    with pytest.raises(CapacityError, match="--encoder-capacities"):
        Capacities((1,), (1,)).pick_encoder(4)


def test_within_engine_options():
    caps = Capacities.plan(max_batch=8, max_num_tokens=64, spec_tokens=3)
    assert caps.within() == caps
    run = caps.within(max_batch=5, max_num_tokens=16, spec_tokens=1)
    assert run == Capacities((1, 2, 4), (1, 2, 4, 8, 16), 1)
    with pytest.raises(CapacityError, match="engine option max_batch=0 is below the smallest built capacity 1"):
        caps.within(max_batch=0)
    with pytest.raises(CapacityError, match="runs 32 rows .*more than max_num_tokens \\(16\\)"):
        caps.within(max_num_tokens=16)
    with pytest.raises(CapacityError, match="spec_tokens"):
        caps.within(spec_tokens=8)
