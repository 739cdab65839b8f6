"""Maintenance scripts of the checkout (not installed): `python -m tools.mutate` plants known bugs and runs the tests
that must catch them."""
