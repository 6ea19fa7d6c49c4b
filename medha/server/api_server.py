"""The server's old import path, kept while medha/cli.py imports from it: new code imports
ServerConfig from medha.server.config and build_app from medha.server.app."""

from medha.server.app import build_app
from medha.server.config import ServerConfig

__all__ = ["ServerConfig", "build_app"]
