"""What a deployment costs: GPU-hours by device kind, from a table the user can override."""

from __future__ import annotations

# Illustrative on-demand prices in US$ per device-hour, of the order cloud providers list for
# one GPU of each kind; they set the ranking of deployments, so pass your own (--prices).
DEFAULT_PRICES = {"a100": 3.0, "h100": 5.0, "h200": 6.5, "cpu": 0.1}


def parse_prices(text: str | None, base: dict[str, float] | None = None) -> dict[str, float]:
    """'h100=4.5,a100=2.1' over the defaults; a bad entry names itself."""
    prices = dict(DEFAULT_PRICES if base is None else base)
    if not text:
        return prices
    for item in text.split(","):
        kind, sep, value = item.partition("=")
        kind = kind.strip().lower()
        try:
            price = float(value)
        except ValueError:
            price = float("nan")
        if not sep or not kind or not price >= 0 or price == float("inf"):
            raise ValueError(
                f"prices: {item.strip()!r} is not KIND=PRICE (US$ per device-hour >= 0)"
            )
        prices[kind] = price
    return prices


def devices(point: dict) -> int:
    return point["replicas"] * point["tp"] * point["spp"] * point["kvp"]


def cost_per_hour(point: dict, prices: dict[str, float]) -> float:
    return devices(point) * prices[point["hardware"]]
