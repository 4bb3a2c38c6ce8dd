"""The numpy references behind the sampling kernel's tests."""

from __future__ import annotations

import numpy as np
import pytest

from cupy_kernels import reference as ref


@pytest.mark.parametrize("counter,key,expect", [
    # Random123's known-answer vectors for Philox4x32-10
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_known_answers(counter, key, expect):
    assert ref.philox4x32_10(counter, key) == expect


def test_uniforms_are_in_range_and_vary():
    us = [ref.sample_uniform(7, off, row) for off in range(50) for row in range(4)]
    assert all(0 <= u < 1 for u in us)
    assert len(set(us)) == len(us)
    assert abs(np.mean(us) - 0.5) < 0.1


def test_top_k_keeps_ties_and_renormalizes():
    logits = np.array([1.0, 3.0, 2.0, 3.0, 0.5])
    p = ref.sampling_probs(logits, top_k=1)
    assert (p > 0).tolist() == [False, True, False, True, False]  # two tied maxima
    assert p.sum() == pytest.approx(1.0)
    p = ref.sampling_probs(logits, top_k=3)
    assert (p > 0).tolist() == [False, True, True, True, False]


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs)
    assert (ref.sampling_probs(logits, top_p=0.5) > 0).tolist() == [True, False, False, False]
    assert (ref.sampling_probs(logits, top_p=0.6) > 0).tolist() == [True, True, False, False]
    assert (ref.sampling_probs(logits, top_p=0.81) > 0).tolist() == [True, True, True, False]
    assert (ref.sampling_probs(logits, top_p=1.0) > 0).all()


def test_temperature_sharpens():
    logits = np.array([0.0, 1.0, 2.0])
    hot, cold = ref.sampling_probs(logits, 2.0), ref.sampling_probs(logits, 0.5)
    assert cold[2] > hot[2] and cold[0] < hot[0]


def test_inverse_cdf_in_index_order():
    logits = np.log(np.array([0.25, 0.25, 0.5]))
    assert [ref.sample(logits, u) for u in (0.0, 0.24, 0.26, 0.49, 0.51, 0.999)] == [0, 0, 1, 1, 2, 2]
