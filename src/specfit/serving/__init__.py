"""``specfit serve``: a SpecFit-enabled model behind transformers' own OpenAI-compatible server (docs/serve.md)."""

from .server import Server, build_app, serve

__all__ = ["Server", "build_app", "serve"]
