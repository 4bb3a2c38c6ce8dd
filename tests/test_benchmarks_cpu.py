"""The benchmarks' arithmetic that needs no GPU: e2e's shares of the roofline and the floor."""

from benchmarks import e2e


def test_roofline_fields_against_a_hand_computation():
    """512 tokens of one row at 0.1 s, 248 MB of weights, 1 MB of cache a row at 2.5 TB/s:
    the roofline is 2.5e12 / 248e6 tok/s and the share is its time over the call's."""
    new = 512
    got = e2e.roofline_fields(0.1, 1, new, 248e6, 1e6, 2500.0)
    weights_s, floor_s = 248e6 / 2.5e12, 249e6 / 2.5e12
    assert got == {"roofline_tok_s": round(1 / weights_s, 1), "pct_roofline": round(100 * weights_s * new / 0.1, 1),
                   "floor_tok_s": round(1 / floor_s, 1), "pct_floor": round(100 * floor_s * new / 0.1, 1)}
    batched = e2e.roofline_fields(0.1, 8, new, 248e6, 1e6, 2500.0)  # the weights once a step, each row's cache
    assert batched["roofline_tok_s"] == round(8 / weights_s, 1)
    assert batched["floor_tok_s"] == round(8 / (weights_s + 8e6 / 2.5e12), 1)


def test_the_shares_take_the_higher_copy_bandwidth():
    """The copy bandwidth measured at the run's start and at its end: the shares take the
    higher, whichever it is, and a higher bandwidth gives lower shares."""
    for start, end in ((2842.0, 2954.6), (2954.6, 2842.0)):
        c = e2e.run_ceilings(start, end)
        assert c == {"copy_GBps": 2954.6, "copy_GBps_start": start, "copy_GBps_end": end}
    low, high = (e2e.roofline_fields(0.8, 1, 512, 3.1e9, 4e6, c) for c in (2842.0, 2954.6))
    assert high["pct_roofline"] < low["pct_roofline"] and high["pct_floor"] < low["pct_floor"]
    assert high["roofline_tok_s"] > low["roofline_tok_s"]
