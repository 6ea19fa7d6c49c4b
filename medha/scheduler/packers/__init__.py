from medha.scheduler.packers.base_packer import PACKERS, Packer, make_packer

__all__ = ["PACKERS", "Packer", "make_packer"]
