"""The shared nearest-rank percentile and the stdlib-only modules' import hygiene."""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokentrace.processors.stats import nearest_rank

PROCESSORS = Path(__file__).resolve().parents[2] / "processors"


@given(
    values=st.lists(st.integers(min_value=-1000, max_value=1000), min_size=1, max_size=60),
    percentile=st.floats(min_value=0, max_value=100),
)
def test_nearest_rank_is_the_smallest_value_covering_the_percentile(
    values: list[int], percentile: float
) -> None:
    ordered = sorted(values)
    value = nearest_rank(ordered, percentile)
    needed = max(1, math.ceil(percentile / 100 * len(ordered)))
    # At least `needed` values are <= it, and fewer than `needed` are strictly below it.
    assert sum(v <= value for v in ordered) >= needed
    assert sum(v < value for v in ordered) < needed


@pytest.mark.parametrize(
    ("percentile", "expected"), [(0, 10), (25, 10), (26, 20), (50, 20), (99, 40), (100, 40)]
)
def test_nearest_rank_never_interpolates(percentile: float, expected: int) -> None:
    assert nearest_rank([10, 20, 30, 40], percentile) == expected


@pytest.mark.parametrize("module", ["stats.py", "durations.py"])
def test_shared_helper_modules_import_only_the_standard_library(module: str) -> None:
    tree = ast.parse((PROCESSORS / module).read_text(encoding="utf-8"))
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.append(node.module)
    outside = [name for name in imported if name.split(".")[0] not in sys.stdlib_module_names]
    assert imported
    assert outside == []
