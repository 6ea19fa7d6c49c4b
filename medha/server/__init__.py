"""The OpenAI-compatible server (`medha serve`)."""
