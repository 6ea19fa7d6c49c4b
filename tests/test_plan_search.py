"""medha plan's capacity search, driven outside the plan's grid (the reproduction benches)."""

from medha.plan.search import capacity_search


def test_capacity_search_halves_then_doubles_and_bisects():
    tried = []

    def run_at(rate):
        tried.append(rate)
        return rate

    cap, capped = capacity_search(run_at, lambda r: r <= 3.3, base=8.0, max_rate=64.0, steps=6)
    assert tried[:3] == [8.0, 4.0, 2.0]  # halved until it held
    assert not capped and 3.0 <= cap <= 3.3
    assert capacity_search(lambda r: r, lambda r: r <= 100, 1.0, 16.0, 3) == (16.0, True)
    assert capacity_search(lambda r: r, lambda r: False, 1.0, 16.0, 3, halvings=2) == (0.0, False)
