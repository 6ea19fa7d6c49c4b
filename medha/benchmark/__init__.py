"""`medha bench`: load generation against OpenAI-compatible servers."""
