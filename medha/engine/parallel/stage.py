"""Stream-pipeline stages: which consecutive layers a stage holds.

The first stage embeds the tokens and, on the engine's process, also computes the logits (the
LM head is the embedding in tied models); the last stage applies the final norm. Layers are
split as evenly as they go, the first stages taking one more.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"stage {self.index} of {self.count} does not exist")

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def layers(self, num_layers: int) -> range:
        if self.count > num_layers:
            raise ValueError(
                f"{self.count} pipeline stages for {num_layers} layers: every "
                "stage needs at least one"
            )
        base, extra = divmod(num_layers, self.count)
        start = self.index * base + min(self.index, extra)
        return range(start, start + base + (1 if self.index < extra else 0))


WHOLE = Stage()
