from medha.scheduler.packers.base_packer import PACKERS, Packer, make_packer, parse_chunking

__all__ = ["PACKERS", "Packer", "make_packer", "parse_chunking"]
