class EngineError(ValueError):
    """A problem with the model, checkpoint or request that the user can fix; the message says
    what and where."""
