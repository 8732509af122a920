"""The `tandem` command line: generate, serve, bench. Thin: parses flags into
config dataclasses and hands them to the packages that do the work."""
__version__ = "0.1.0"
