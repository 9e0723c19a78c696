"""The size syntax, under the name ``tests/test_cli.py`` imports it by; it lives in
:mod:`benchmarks.common.sizes`. Remove this module once that test imports it from there."""

from .common.sizes import parse_size as parse_size
from .common.sizes import parse_sizes as parse_sizes
