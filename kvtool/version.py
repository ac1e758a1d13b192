"""kvtool's version, in a module of its own so that any part can name it without importing the rest."""

__version__ = "0.1.0"
