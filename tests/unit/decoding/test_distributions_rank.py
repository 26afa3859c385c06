"""`softmax` and `log_softmax` over the last axis of an array of any rank (a batch of beams of rows, (B, K, V)), as
their docstrings say: each (B, K) row is normalised on its own."""

from __future__ import annotations

import numpy as np

from service.decoding.distributions import log_softmax, softmax


def test_softmax_normalises_the_last_axis_of_a_3d_array():
    x = np.random.default_rng(0).standard_normal((2, 3, 5)).astype(np.float32)
    p = softmax(x)
    assert p.dtype == np.float32 and p.shape == (2, 3, 5)
    np.testing.assert_allclose(p.sum(axis=-1), np.ones((2, 3)), rtol=1e-6)
    np.testing.assert_allclose(p[1, 2], np.exp(x[1, 2]) / np.exp(x[1, 2]).sum(), rtol=1e-6)


def test_log_softmax_normalises_the_last_axis_of_a_3d_array():
    x = np.random.default_rng(1).standard_normal((2, 2, 4))
    lp = log_softmax(x)
    np.testing.assert_allclose(np.exp(lp).sum(axis=-1), np.ones((2, 2)))
    np.testing.assert_allclose(lp[1, 0], x[1, 0] - np.log(np.exp(x[1, 0]).sum()))
