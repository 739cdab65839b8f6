"""Command-line tools (AOT compile report)."""
