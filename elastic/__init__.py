"""elastic: keep every GPU busy."""
__version__ = "0.1.0"
