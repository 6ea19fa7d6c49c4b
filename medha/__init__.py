"""medha: serving LLM requests of every length without convoys."""

__version__ = "0.1.0"
