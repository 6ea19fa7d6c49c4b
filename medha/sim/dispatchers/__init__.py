from medha.sim.dispatchers.base_dispatcher import DISPATCHERS, Dispatcher

__all__ = ["DISPATCHERS", "Dispatcher"]
