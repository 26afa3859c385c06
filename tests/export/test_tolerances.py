"""The quality checks' tolerances (export.tolerances): an accuracy's comes from its sample size, so a graph variant
or another CPU's kernels flipping a few near-tie images of a small fixture set is not a failure, while the release
set's 10,000 images keep it to a few tenths of a point."""

import pytest

from export.tolerances import TOLERANCES, accuracy_tolerance, quality_tolerance, within


@pytest.mark.parametrize("percent, count, floor, expected", [
    (70.0, 500, 0.2, 2.05),      # the tiny ViT on the 500 fixture images: ~10 images
    (92.0, 10_000, 0.2, 0.27),   # a release ViT on the full test split
    (91.69, 10_000, 0.1, 0.28),  # verify_served's floor is below the standard error there
    (100.0, 500, 0.2, 0.2),      # a perfect score has no binomial spread: the floor
    (0.0, 10, 0.2, 0.2),
    (50.0, 1, 0.2, 50.0),        # one image: anything between 0 and 100 is one standard error from 50
])
def test_accuracy_tolerance_is_the_binomial_standard_error_or_the_floor(percent, count, floor, expected):
    assert accuracy_tolerance(percent, count, floor) == expected


@pytest.mark.parametrize("count", [0, -5])
def test_accuracy_tolerance_needs_examples(count):
    with pytest.raises(ValueError, match="at least one example"):
        accuracy_tolerance(90.0, count, 0.2)


@pytest.mark.parametrize("metric, reference, count, delta, ok", [
    ("test_accuracy", 69.2, 500, 0.4, True),     # 2 of 500 images flipped on an AVX2 CPU (issue 25, item 16)
    ("test_accuracy", 69.2, 500, -2.4, False),   # 12 images: more than the sample explains
    ("test_accuracy", 92.0, 10_000, -0.3, False),
    ("val_loss", 1.47, 111_540, 0.002, True),
    ("val_loss", 1.47, 111_540, -0.5, True),      # a lower loss is never a failure
    ("val_loss", 1.47, 111_540, 0.0021, False),
    ("bleu", 38.0, 1000, -0.3, True),
    ("bleu", 38.0, 1000, 0.31, False),
])
def test_quality_tolerance_by_metric(metric, reference, count, delta, ok):
    tolerance = quality_tolerance(metric, reference, count)
    if metric != "test_accuracy":
        assert tolerance == TOLERANCES[metric]
    assert within(metric, delta, tolerance) is ok
