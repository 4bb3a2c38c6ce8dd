"""The benchmarks' work that needs no GPU: e2e's shares of the roofline and the floor, and
decode_step's merge of a run's parts."""

import json

import pytest

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


def _part(path, device, copy, rows, py="3.12.3"):
    doc = {"device": device, "date": "2026-01-01T00:00:00+00:00", "versions": {"python": py, "cupy": "14.2.0"},
           "ceilings": {"copy_GBps": copy}, "rows": rows}
    path.write_text(json.dumps(doc))
    return str(path)


def test_merge_takes_the_parts_device_and_versions(tmp_path, monkeypatch):
    """decode_step --merge on a machine without a GPU: the file names the parts' device and
    versions, each row its part's copy bandwidth; a step in two parts or parts of two devices
    are refused."""
    from benchmarks import common, decode_step

    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    step = {"bench": "decode_step", "model": "gpt2", "dtype": "float16", "batch": 1, "step_us": 200.0}
    gemv = {"bench": "gemv", "model": "gpt2", "dtype": "float16", "batch": 1, "role": "qkv", "impl": "ours"}
    a = _part(tmp_path / "a.json", "NVIDIA H100 80GB HBM3", 2950.0, [gemv])
    b = _part(tmp_path / "b.json", "NVIDIA H100 80GB HBM3", 2900.0, [step])
    path = decode_step.merge([a, b])
    assert path.name == "decode_step-h100.json"
    doc = json.loads(path.read_text())
    assert doc["device"] == "NVIDIA H100 80GB HBM3" and doc["versions"] == {"python": "3.12.3", "cupy": "14.2.0"}
    assert [r["copy_GBps"] for r in doc["rows"]] == [2950.0, 2900.0]
    assert doc["ceilings"] == {"copy_GBps_min": 2900.0, "copy_GBps_max": 2950.0}
    assert [p["file"] for p in doc["parts"]] == ["a.json", "b.json"]
    c = _part(tmp_path / "c.json", "NVIDIA H100 80GB HBM3", 2900.0, [], py="3.11.0")
    assert json.loads(decode_step.merge([a, c]).read_text())["versions"] == {}  # each part's, in parts
    with pytest.raises(ValueError, match="both hold"):
        decode_step.merge([a, b, _part(tmp_path / "e.json", "NVIDIA H100 80GB HBM3", 2900.0, [step])])
    with pytest.raises(ValueError, match="several devices"):
        decode_step.merge([a, _part(tmp_path / "d.json", "NVIDIA H200", 4000.0, [step])])
